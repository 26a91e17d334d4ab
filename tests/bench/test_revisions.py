"""bench/service/revisions.py: the baseline's own sources serve, and every round's figure is read back in order."""

from __future__ import annotations

import json
import subprocess

from bench.service import revisions


def test_the_baseline_worktree_holds_that_revision_and_goes_away():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=revisions.ROOT, capture_output=True, text=True).stdout
    with revisions.worktree("HEAD") as tree:
        checked_out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout
        assert checked_out == head
        assert (tree / "lmq" / "serve.py").exists()  # `python -m lmq` from there imports the baseline's code
    assert not tree.exists()
    listed = subprocess.run(["git", "worktree", "list"], cwd=revisions.ROOT, capture_output=True, text=True).stdout
    assert str(tree) not in listed


def test_round_figures_come_in_round_order(tmp_path):
    for label, figures in (("baseline", [10.0, 11.0, 12.0] + [13.0] * 8), ("this", [20.0] * 11)):
        for index, value in enumerate(figures, start=1):
            report = {"levels": [{"concurrency": 16, "output_tok_s": value}]}
            (tmp_path / f"revisions-{label}-c16-r{index}.json").write_text(json.dumps(report))
    figures = revisions.round_figures(tmp_path, ["baseline", "this"], 16)
    assert figures["baseline"][:4] == [10.0, 11.0, 12.0, 13.0]  # r10 and r11 after r9, not after r1
    assert len(figures["this"]) == 11
