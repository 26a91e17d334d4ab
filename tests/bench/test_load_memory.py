"""bench/engine/load_memory.py: a fresh process loads the model as a worker does and reports /proc's figures."""

from __future__ import annotations

import pytest

from bench.engine.load_memory import lmq
from bench.harness.processes import ROOT
from worker.model.loader import default_model_path


@pytest.mark.slow  # loads the default model in a child process (~5 s)
def test_the_child_reports_the_load_s_seconds_and_memory() -> None:
    row = lmq(ROOT, default_model_path())
    assert row["seconds"] > 0
    assert 0 < row["RssAnon"] <= row["VmRSS"] <= row["VmHWM"]
    assert row["RssFile"] > 0  # the GGUF's mapped pages
