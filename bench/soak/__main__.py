"""`python -m bench.soak`: the chaos soak (bench/soak/runner.py)."""

import sys

from bench.soak.runner import main

sys.exit(main())
