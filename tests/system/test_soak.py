"""The chaos soak's 2-minute version (bench/soak/runner.py; `make soak` runs it for 30 minutes).

Real processes (a gateway, two workers on the tiny float32 model, one Redis with its append-only file),
mixed traffic (both APIs streamed and not, n = 2, tools, structured output, a foreign producer on a
reply stream, batch jobs, clients that hang up), and a fault every 18 s, each kind once: a worker
SIGKILLed, a worker SIGSTOPped past the claim time, the gateway SIGKILLed and restarted, Redis
SIGKILLed and restarted, poison entries. Every request must end exactly as its reference or with an
error its client could see: none lost, none wrong; every fault injected and undone; the queue drained
and no short-lived key left without a TTL.
"""

from __future__ import annotations

import pytest

from bench.soak.faults import KINDS
from bench.soak.runner import build_parser, run_soak, text_report

pytestmark = pytest.mark.timeout(600)


async def test_two_minutes_of_mixed_traffic_under_faults_lose_nothing_and_answer_nothing_wrong(tmp_path):
    args = build_parser().parse_args(
        ["--minutes", "2", "--fault-interval", "18", "--clients", "4", "--prompts", "3", "--root", str(tmp_path)]
    )
    report = await run_soak(args)
    summary = text_report(report)
    assert not report["failures"], summary + f"\n{report['failures']}"
    assert report["verdicts"].get("exact", 0) > 0, summary
    assert set(report["faults"]) == set(KINDS), summary
    assert not report["problems"], summary
    assert report["passed"], summary
