"""The chaos soak in short (bench/soak/runner.py; `make soak` runs it for 30 minutes).

Real processes (a gateway, two workers on the tiny float32 model, one Redis with its append-only file),
mixed traffic (both APIs streamed and not, n = 2, tools, structured output, a foreign producer on a
reply stream, batch jobs, clients that hang up), and faults in turn, each kind at least once: a worker
SIGKILLed, a worker SIGSTOPped past the claim time, the gateway SIGKILLed and restarted, Redis
SIGKILLed and restarted, poison entries. Every request must end exactly as its reference or with an
error its client could see: none lost, none wrong; every fault injected and undone; the queue drained
and no short-lived key left without a TTL.

`make test` runs one minute with a fault every 6 s (the five kinds take ~45 s with their recoveries on
two busy cores); `make test-long` also runs two minutes with a fault every 18 s, the same checks with
more traffic between two faults.
"""

from __future__ import annotations

import pytest

from bench.soak.faults import KINDS
from bench.soak.runner import build_parser, run_soak, text_report

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize(
    ("minutes", "fault_interval"),
    [pytest.param("1", "6", id="1-minute"), pytest.param("2", "18", id="2-minutes", marks=pytest.mark.long)],
)
async def test_mixed_traffic_under_faults_loses_nothing_and_answers_nothing_wrong(tmp_path, minutes, fault_interval):
    args = build_parser().parse_args(
        ["--minutes", minutes, "--fault-interval", fault_interval, "--clients", "4", "--prompts", "3"]
        + ["--root", str(tmp_path)]
    )
    report = await run_soak(args)
    summary = text_report(report)
    assert not report["failures"], summary + f"\n{report['failures']}"
    assert report["verdicts"].get("exact", 0) > 0, summary
    assert set(report["faults"]) == set(KINDS), summary
    assert not report["problems"], summary
    assert report["passed"], summary
