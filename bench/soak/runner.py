"""The chaos soak: mixed traffic through real processes while a fault lands every ~30 s.

    python -m bench.soak --minutes 30 --json bench/results/soak.json     # `make soak`
    python -m bench.soak --minutes 1 --fault-interval 6                   # the version `make test` runs

A gateway, two workers (the tiny float32 model, steps slowed so faults land mid-stream) and one Redis
with its append-only file (bench/soak/stack.py). First every (kind, prompt) runs once with no fault:
its answer is the reference. Then for `--minutes`: `--clients` closed-loop clients send every kind in
turn (bench/soak/traffic.py), a foreign producer writes the protocol straight into Redis, batch jobs
run one after another (bench/soak/batches.py), and the scheduler injects a fault every
`--fault-interval` seconds (bench/soak/faults.py), while the sampler records memory and key counts
(bench/soak/resources.py). Every request is a line of the ledger (bench/soak/ledger.py). At the end,
with traffic stopped and the queue drained, it checks what is left.

The soak fails (exit 1) on any lost or wrong answer, a fault that could not be injected or undone,
a poison entry not dead-lettered, or leftovers (a queue not drained, a short-lived key without TTL).
Visible errors are allowed: they are what a client is promised when it cannot get its answer.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from bench.soak.answers import Answer
from bench.soak.batches import run_batches
from bench.soak.faults import KINDS, SENTINEL_KINDS, FaultScheduler
from bench.soak.ledger import Ledger
from bench.soak.resources import ResourceSampler
from bench.soak.traffic import (
    Target,
    anthropic_request,
    chat_body,
    hang_up,
    send_anthropic,
    send_foreign,
    send_openai,
)

CLIENT_KINDS = ("openai_stream", "openai", "openai_n2_stream", "openai_tools", "openai_json_stream",
                "anthropic_stream", "anthropic", "hang_up")  # fmt: skip
JUDGED = tuple(kind for kind in CLIENT_KINDS if kind != "hang_up") + ("foreign",)
PROMPTS = [f"Soak {i}: tell me about the weather in a small town." for i in range(6)]
CLIENT_TIMEOUT_S = 60.0
DRAIN_S = 90.0
AFTER_ERROR_S = 0.5  # a client that saw a connection error waits this long before its next request


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="traffic time, after the reference run")
    parser.add_argument("--fault-interval", type=float, default=30.0, help="seconds between two faults")
    parser.add_argument("--topology", choices=["redis", "sentinel"], default="redis",
                        help="one Redis with its append-only file, or a Sentinel set (1 primary, 1 replica, 3 sentinels)")  # fmt: skip
    parser.add_argument("--faults", help=f"fault kinds, in turn (default: {','.join(KINDS)}; with a Sentinel set "
                        f"{','.join(SENTINEL_KINDS)})")  # fmt: skip
    parser.add_argument("--clients", type=int, default=6, help="closed-loop HTTP clients")
    parser.add_argument(
        "--prompts", type=int, default=4, help="distinct prompts (each kind's reference is one run per prompt)"
    )
    parser.add_argument("--batch-items", type=int, default=4)
    parser.add_argument("--sample-interval", type=float, default=5.0)
    parser.add_argument("--root", type=Path, help="where processes log (default: a temporary directory)")
    parser.add_argument("--json", type=Path)
    return parser


async def send(kind: str, session: aiohttp.ClientSession, target: Target, prompt: str) -> Answer:
    if kind == "foreign":
        return await send_foreign(target, prompt)
    if kind == "hang_up":
        return await hang_up(session, target, prompt)
    if kind.startswith("anthropic"):
        return await send_anthropic(session, target, anthropic_request(prompt, stream=kind.endswith("stream")))
    return await send_openai(session, target, chat_body(kind, prompt))


async def references(session, target: Target, prompts: list[str]) -> dict[tuple[str, int], Answer]:
    """Each judged (kind, prompt) once, before any fault; a reference that failed stops the soak."""
    keys = [(kind, index) for kind in JUDGED for index in range(len(prompts))]
    limit = asyncio.Semaphore(4)

    async def one(key: tuple[str, int]) -> Answer:
        async with limit:
            return await send(key[0], session, target, prompts[key[1]])

    answers = dict(zip(keys, await asyncio.gather(*(one(key) for key in keys))))
    bad = {
        key: answer.describe() for key, answer in answers.items() if answer.error or answer.hung or not answer.complete
    }
    if bad:
        raise RuntimeError(f"the reference run (no faults) failed: {bad}")
    return answers


class Soak:
    def __init__(self, stack, args: argparse.Namespace):
        self.stack = stack
        self.args = args
        self.ledger = Ledger()
        self.prompts = PROMPTS[: args.prompts]
        self.stopping = False
        self.refs: dict[tuple[str, int], Answer] = {}
        self.drain_deadline = float("inf")

    def target(self, redis) -> Target:
        return Target(self.stack.gateway_url, redis, self.stack.model, self.stack.request_stream, CLIENT_TIMEOUT_S)

    def record(self, kind: str, index: int, started: float, answer: Answer) -> None:
        reference = None if kind == "hang_up" else self.refs[("openai" if kind == "batch" else kind, index)]
        line = self.ledger.record(kind, index, started, time.monotonic(), answer, reference)
        if line.verdict in ("lost", "wrong"):
            print(f"soak: {line.verdict} {kind} prompt {index}: {line.detail}", flush=True)

    async def client(self, session, target: Target, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stopping:
            kind, index = rng.choice(CLIENT_KINDS), rng.randrange(len(self.prompts))
            started = time.monotonic()
            answer = await send(kind, session, target, self.prompts[index])
            self.record(kind, index, started, answer)
            if answer.error and answer.error.startswith("connection"):
                await asyncio.sleep(AFTER_ERROR_S)

    async def foreign(self, target: Target) -> None:
        index = 0
        while not self.stopping:
            started = time.monotonic()
            answer = await send_foreign(target, self.prompts[index % len(self.prompts)])
            self.record("foreign", index % len(self.prompts), started, answer)
            index += 1

    async def run(self) -> dict:
        redis = self.stack.async_admin()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
            target = self.target(redis)
            began = time.monotonic()
            self.refs = await references(session, target, self.prompts)
            reference_s = time.monotonic() - began
            print(
                f"soak: {len(self.refs)} references in {reference_s:.0f} s; traffic for {self.args.minutes:g} min",
                flush=True,
            )
            end = time.monotonic() + self.args.minutes * 60
            over: Callable[[], bool] = lambda: time.monotonic() >= end  # noqa: E731
            kinds = SENTINEL_KINDS if self.args.topology == "sentinel" else KINDS
            kinds = tuple(self.args.faults.split(",")) if self.args.faults else kinds
            scheduler = FaultScheduler(self.stack, self.ledger, self.args.fault_interval, kinds)
            sampler = ResourceSampler(self.stack, self.args.sample_interval)
            traffic = [asyncio.create_task(self.client(session, target, seed)) for seed in range(self.args.clients)]
            traffic.append(asyncio.create_task(self.foreign(target)))
            batch_record = lambda index, started, answer: self.record("batch", index, started, answer)  # noqa: E731
            traffic.append(asyncio.create_task(run_batches(
                session, target, self.prompts, self.args.batch_items, batch_record, over, lambda: self.drain_deadline)))  # fmt: skip
            sampling = asyncio.create_task(sampler.run(lambda: self.stopping and self.drained))
            self.drained = False
            await scheduler.run(over)
            self.stopping = True
            self.drain_deadline = time.monotonic() + DRAIN_S + CLIENT_TIMEOUT_S
            await asyncio.gather(*traffic)
            await self.stack.wait_ready()
            drained = await self.wait_drained(DRAIN_S)
            self.drained = True
            await sampling
            final = await asyncio.to_thread(sampler.sample)
            leftovers = await asyncio.to_thread(sampler.leftovers)
        await redis.aclose()
        summary = self.ledger.summary()
        problems = scheduler.problems + leftovers + ([] if drained else ["the queue did not drain"])
        return {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpu": cpu_model(), "cores": os.cpu_count()},
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.args).items()},
            "reference_s": round(reference_s, 1),
            **summary,
            "resources": sampler.trend(),
            "after_drain": final,
            "problems": problems,
            "passed": not summary["failures"] and not problems,
        }

    async def wait_drained(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            queue = await asyncio.to_thread(self.stack.queue)
            if not queue["entries"] and not queue["pending"]:
                return True
            await asyncio.sleep(1.0)
        return False


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def text_report(report: dict) -> str:
    lines = [
        f"soak: {report['requests']} requests, verdicts {report['verdicts']}",
        f"faults: {report['faults']}",
        f"visible errors by fault: {report['visible_errors_by_fault']}",
        f"TTFT s under faults {report['ttft_s']['under_faults']}, without {report['ttft_s']['no_fault']}",
        "by kind: " + "; ".join(f"{kind} {counts}" for kind, counts in report["by_kind"].items()),
        f"resources over time: {json.dumps(report['resources'])}",
        f"after the drain: {json.dumps(report['after_drain'])}",
        f"problems: {report['problems'] or 'none'}",
        f"{'PASSED' if report['passed'] else 'FAILED'}",
    ]
    return "\n".join(lines)


async def run_soak(args: argparse.Namespace) -> dict:
    from bench.soak.stack import SoakStack

    root = args.root or Path(tempfile.mkdtemp(prefix="lmq-soak-"))
    with SoakStack(root, args.topology) as stack:
        await stack.wait_ready()
        report = await Soak(stack, args).run()
    report["logs"] = str(root)
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = asyncio.run(run_soak(args))
    print(text_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
