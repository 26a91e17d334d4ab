"""bench/gpu/check.py's plumbing on a CPU: a real dry-run phase, the time limits, wheels, junit parsing, the report.

The figures need the GPU machine; what can break before it gets there is tested here.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import check as gpu_check
from bench.gpu.report import render

pytestmark = pytest.mark.system  # its phases are child processes, killed and timed

ROOT = Path(__file__).resolve().parents[2]


def run_check(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu.check", "--out", str(out), "--work", str(tmp_path / "work"), "--device", "cpu", "--dry-run", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert (out / "gpu-check.log").exists(), done.stderr
    return done.returncode, json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def test_a_dry_run_phase_records_its_figures_in_both_reports(tmp_path: Path) -> None:
    code, report, markdown = run_check(tmp_path, "--phases", "kernel")
    assert code == 0
    kernel = report["phases"]["kernel"]
    assert kernel["status"] == "ok"
    cases = [value for value in kernel["results"].values() if isinstance(value, dict)]
    assert {case["layout"] for case in cases} == {"smollm2-135m", "llama-3.2-1b"}
    assert all(case["max_abs_diff"] < 0.05 for case in cases)  # paged decode and gather + SDPA agree (bfloat16)
    assert "| smollm2-135m | 2 | 40 |" in markdown
    assert report["phases"]["wheels"]["status"] == "skipped"  # everything imports here


def test_phases_that_do_not_fit_the_total_are_skipped(tmp_path: Path) -> None:
    code, report, markdown = run_check(tmp_path, "--total", "0")
    assert code == 0
    names = [phase.name for phase in gpu_check.PHASES]
    assert [name for name in report["phases"] if name != "wheels"] == names
    assert all(report["phases"][name]["status"] == "skipped" for name in names)
    assert "| service | skipped |" in markdown


def test_a_phase_past_its_time_is_killed_with_its_children(tmp_path: Path) -> None:
    marker = tmp_path / "child-still-running"
    child = tmp_path / "child.py"  # outlives a kill of its parent alone, and then writes the marker
    child.write_text(f"import time\ntime.sleep(2)\nopen({str(marker)!r}, 'w').close()\n")
    parent = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, {str(child)!r}])\ntime.sleep(30)\n"
    command = [sys.executable, "-c", parent]
    status, code = gpu_check.run_subprocess(command, dict(os.environ), timeout_s=0.5, log=subprocess.DEVNULL)
    assert (status, code) == ("timeout", None)
    subprocess.run([sys.executable, "-c", "import time; time.sleep(3)"], check=True)
    assert not marker.exists()


def test_missing_modules_without_wheels_fail_the_wheel_step(tmp_path: Path, monkeypatch) -> None:
    assert gpu_check.install_wheels(tmp_path, io.StringIO())["status"] == "skipped"
    monkeypatch.setattr(gpu_check, "REQUIRED_MODULES", [*gpu_check.REQUIRED_MODULES, "no_such_module_here"])
    result = gpu_check.install_wheels(tmp_path, io.StringIO())
    assert result["status"] == "failed" and "no_such_module_here" in result["detail"]


def test_junit_results_keep_outcomes_and_recorded_figures(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(
        """<testsuites><testsuite>
        <testcase name="test_a" time="1.5"><properties><property name="rel_err_max" value="0.01"/></properties></testcase>
        <testcase name="test_b" time="0.1"><failure message="assert 0.2 &lt;= 0.06">trace</failure></testcase>
        <testcase name="test_c" time="0"><skipped message="needs CUDA"/></testcase>
        </testsuite></testsuites>"""
    )
    results = gpu_check.junit_results(path)
    assert results["test_a"] == {"outcome": "passed", "seconds": 1.5, "rel_err_max": "0.01"}
    assert results["test_b"]["outcome"] == "failed" and results["_failures"]["test_b"] == "assert 0.2 <= 0.06"
    assert results["test_c"]["outcome"] == "skipped"
    assert gpu_check.junit_results(tmp_path / "absent.xml") == {}


def test_the_report_judges_targets_from_partial_results() -> None:
    report = {
        "date": "2026-11-30", "command": "python -m bench.gpu.check --out x", "environment": {"gpu": "NVIDIA H200"},
        "phases": {
            "bench-smollm2-135m": {"status": "timeout", "seconds": 90, "budget_s": 90, "results": {
                "lmq_decode_1": {"streams": 1, "decode_tok_s": 700.0, "step_ms_median": 1.4, "run_tok_s": 650.0, "graph_replays": 63},
                "lmq_decode_256": {"streams": 256, "decode_tok_s": 39000.0, "step_ms_median": 6.5, "run_tok_s": 30000.0, "graph_replays": 63},
                "hf_decode_1": {"streams": 1, "decode_tok_s": 70.0},
            }},
            "service": {"status": "ok", "results": {"level_256": {"streams": 256, "output_tok_s": 28000.0, "completed": 512, "errors": 0,
                                                                  "ttft_median_s": 0.05}}},
        },
    }  # fmt: skip
    markdown = render(report)
    assert "| 1 | 700 | 1.40 | 650 | 63 | 70 | 10.0 | 600 met |" in markdown
    assert "| 256 | 39,000 | 6.50 | 30,000 | 63 | - | - | 40,000 missed |" in markdown
    assert "| 256 | 28,000 | 30,000 | 0.93 | met | 50 | 512 / 0 |" in markdown
