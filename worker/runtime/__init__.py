"""Where a step runs: the step backend (backend.py), its implementations (one file each) and the one selector (select.py)."""
