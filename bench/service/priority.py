"""Priorities under load: interactive time to first token with a batch job saturating the worker, and
the batch job's throughput next to the engine's.

    .venv/bin/python bench/service/priority.py                      # the default model, 2 threads
    .venv/bin/python bench/service/priority.py --model tests/...    # any model lmq loads

One `lmq serve` (embedded Redis, one worker, one gateway). What it measures:

- **engine throughput** (first, in this process, before the server starts): the job's requests
  handed to an `Engine` all at once, with the worker's settings and thread count: what the engine
  does with this work with no queue, gateway or batch machinery at all;
- **batch throughput**: the same requests as one OpenAI batch (client.batches.create), nothing
  else running: completion tokens / (creation → completed);
- **idle TTFT**: streaming chat completions from 1, then 4, closed-loop interactive streams;
- **TTFT under batch load**: a batch of `--load-items` running (the worker full of batch work),
  then the same interactive levels; the load batch's throughput meanwhile; then it is cancelled.
  Idle and loaded levels alternate `--rounds` times and each level's TTFTs are pooled, so a host
  whose speed drifts (shared cores) skews the idle and the loaded figures alike.

Targets (issue #17): TTFT under load ≤ 1.5 × idle at 1 and 4 streams; batch ≥ 90 % of the engine.

Throughput is given twice: per wall-clock second, and per CPU second (the engine: this process;
the batch: the `lmq serve` process and its Redis). On a machine shared with other work, wall-clock
figures follow how much of the cores each run got; CPU seconds say what the work itself cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

# OpenMP threads that spin while they wait burn CPU seconds that are not work, and on shared cores
# take them from the other runs: a short spin, then sleep, as the worker waits (worker/config.py), in this
# process and the server it starts.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

import aiohttp
import openai

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import processes
from bench.harness.client import ChatClient
from bench.harness.stats import RequestResult
from lmq.redis_server import free_tcp_port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model file or directory; empty = the default model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-seqs", type=int, default=64, help="the worker's --max-seqs")
    parser.add_argument(
        "--in-flight", type=int, default=256, help="the gateway's --batch-in-flight, and the engine run's concurrency"
    )
    parser.add_argument("--items", type=int, default=128, help="requests of the throughput job")
    parser.add_argument(
        "--load-items", type=int, default=1000, help="requests of the batch that loads the worker during step 4"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="completion tokens of each batch request")
    parser.add_argument("--ttft-requests", type=int, default=16, help="interactive requests per level")
    parser.add_argument("--ttft-max-tokens", type=int, default=8)
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="idle and loaded TTFT levels alternate this many times; the TTFTs are pooled",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    return parser


def question(index: int) -> list[dict[str, str]]:
    """Distinct from the first token on, so no request finds another's prompt in the prefix cache."""
    return [
        {
            "role": "user",
            "content": f"{index} - Question number {index}: describe, in a few sentences, a city you would like to visit.",
        }
    ]


def batch_line(index: int, model: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": question(index), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {"custom_id": f"r{index}", "method": "POST", "url": "/v1/chat/completions", "body": body}


@contextlib.contextmanager
def lmq_serve(args: argparse.Namespace, logs: Path):
    port = free_tcp_port()
    with tempfile.TemporaryDirectory(prefix="lmq-bench-priority-") as scratch:
        command = processes.python_command(
            "-m", "lmq", "serve", "--port", str(port), "--threads", str(args.threads),
            "--max-seqs", str(args.max_seqs), "--batch-in-flight", str(args.in_flight), "--max-queue", "100000",
            *(["--model", str(Path(args.model).resolve())] if args.model else []),
        )  # fmt: skip
        process = processes.start(command, logs / "lmq-serve.log", cwd=Path(scratch))
        try:
            processes.wait_http_ok(f"http://127.0.0.1:{port}/ready", [process], timeout_s=600)
            yield f"http://127.0.0.1:{port}", " ".join(command[1:]), process.pid
        finally:
            processes.stop(process)


async def ttft_level(client: ChatClient, streams: int, requests: int, first_index: int, max_tokens: int) -> dict:
    """`requests` interactive requests from `streams` closed-loop streams: TTFT p50/p95 in ms."""
    queue = list(range(first_index, first_index + requests))
    results: list[RequestResult] = []

    async def stream() -> None:
        while queue:
            index = queue.pop(0)
            results.append(await client.stream_chat(client.chat_body(question(index), max_tokens, True), 600))

    await asyncio.gather(*(stream() for _ in range(streams)))
    errors = [r.error for r in results if not r.ok]
    if errors:
        raise RuntimeError(f"{len(errors)} interactive requests failed: {errors[:3]}")
    return level_figures(streams, [r.ttft * 1000 for r in results])


def level_figures(streams: int, ttfts_ms: list[float]) -> dict:
    ttfts = sorted(ttfts_ms)
    return {
        "streams": streams, "requests": len(ttfts), "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p95_ms": ttfts[int(0.95 * (len(ttfts) - 1))], "ttfts_ms": ttfts,
    }  # fmt: skip


def pooled(rounds: list[list[dict]]) -> list[dict]:
    """Each level's TTFTs of every round together (rounds: [[level per streams], ...])."""
    return [
        level_figures(levels[0]["streams"], [t for level in levels for t in level["ttfts_ms"]])
        for levels in zip(*rounds)
    ]


def engine_throughput(args: argparse.Namespace, first_index: int) -> dict:
    """The job's requests given to an Engine in this process all at once: completion tokens/s."""
    import torch

    from protocol import SamplingParams
    from worker import compute_thread
    from worker.engine import Engine, GenRequest
    from worker.model.loader import load_model
    from worker.prompt import build_prompt_ids

    torch.set_num_threads(args.threads)
    model = compute_thread.run(load_model, args.model or None, dtype="auto", quant="auto", device="cpu")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    requests = [
        GenRequest(
            f"r{i}",
            build_prompt_ids(model, messages=question(i), max_tokens=args.max_tokens, truncate=False),
            params,
            priority="batch",
        )
        for i in range(first_index, first_index + args.items)
    ]
    tokens = 0

    def on_step(outputs) -> None:
        nonlocal tokens
        tokens += sum(len(output.token_ids) for output in outputs)

    async def run() -> float:
        engine = Engine(model, max_seqs=args.max_seqs, on_step=on_step)
        for request in requests:
            engine.add(request)
        engine.stop()
        started = time.perf_counter()
        await engine.run()
        return time.perf_counter() - started

    cpu = time.process_time()
    wall = asyncio.run(run())
    cpu = time.process_time() - cpu
    return {
        "requests": args.items,
        "completion_tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "tokens_per_cpu_s": tokens / cpu,
    }


def service_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its children (lmq serve's embedded Redis)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return processes.cpu_seconds(pid) + sum(processes.cpu_seconds(child) for child in children)


async def create_batch(sdk: openai.AsyncOpenAI, model: str, first_index: int, count: int, max_tokens: int):
    data = "".join(
        json.dumps(batch_line(i, model, max_tokens)) + "\n" for i in range(first_index, first_index + count)
    ).encode()
    upload = await sdk.files.create(file=("job.jsonl", io.BytesIO(data)), purpose="batch")
    return await sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")


async def batch_throughput(
    sdk: openai.AsyncOpenAI, model: str, args: argparse.Namespace, first_index: int, server_pid: int
) -> dict:
    cpu, started = service_cpu_seconds(server_pid), time.perf_counter()
    batch = await create_batch(sdk, model, first_index, args.items, args.max_tokens)
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        await asyncio.sleep(0.1)
        batch = await sdk.batches.retrieve(batch.id)
    wall, cpu = time.perf_counter() - started, service_cpu_seconds(server_pid) - cpu
    if batch.status != "completed" or batch.request_counts.failed:
        raise RuntimeError(f"the throughput batch ended {batch.status}: {batch.request_counts}")
    tokens = batch.usage.output_tokens
    return {
        "requests": args.items,
        "completion_tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "tokens_per_cpu_s": tokens / cpu,
    }


async def loaded_levels(
    client: ChatClient, sdk: openai.AsyncOpenAI, model: str, args: argparse.Namespace, first_index: int
) -> dict:
    """The TTFT levels while a large batch keeps the worker full; that batch's throughput meanwhile."""
    load = await create_batch(sdk, model, first_index, args.load_items, args.max_tokens)
    while (await sdk.batches.retrieve(load.id)).request_counts.completed < 1:  # the worker is full and turning over
        await asyncio.sleep(0.2)
    before, started = await sdk.batches.retrieve(load.id), time.perf_counter()
    levels = []
    for offset, streams in enumerate((1, 4)):
        levels.append(
            await ttft_level(
                client, streams, args.ttft_requests, first_index + args.load_items + offset * 1000, args.ttft_max_tokens
            )
        )
    after, wall = await sdk.batches.retrieve(load.id), time.perf_counter() - started
    if after.status != "in_progress":
        raise RuntimeError(f"the load batch ran out during the measurement ({after.status}): raise --load-items")
    await sdk.batches.cancel(load.id)
    tokens = after.usage.output_tokens - before.usage.output_tokens
    return {"levels": levels, "batch_tokens_per_s_meanwhile": tokens / wall}


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{cpu}, {os.cpu_count()} cores"


async def measure(args: argparse.Namespace, base: str, server_pid: int) -> dict:
    async with aiohttp.ClientSession() as session:
        client = ChatClient(session, base + "/v1")
        client.model = await client.first_model()
        sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        await ttft_level(client, 2, 4, 900_000, args.ttft_max_tokens)  # warm-up
        batch = await batch_throughput(sdk, client.model, args, 300_000, server_pid)
        idle_rounds, loaded_rounds, meanwhile = [], [], []
        for round_index in range(args.rounds):  # idle, loaded, idle, loaded: the host's drift hits both alike
            first = 1_000_000 * (round_index + 1)
            idle_rounds.append(
                [
                    await ttft_level(client, streams, args.ttft_requests, first + streams * 1000, args.ttft_max_tokens)
                    for streams in (1, 4)
                ]
            )
            loaded = await loaded_levels(client, sdk, client.model, args, first + 100_000)
            loaded_rounds.append(loaded["levels"])
            meanwhile.append(loaded["batch_tokens_per_s_meanwhile"])
    loaded = {"levels": pooled(loaded_rounds), "batch_tokens_per_s_meanwhile": statistics.mean(meanwhile)}
    return {"model": client.model, "idle": pooled(idle_rounds), "batch": batch, "loaded": loaded}


def with_ratios(figures: dict) -> dict:
    idle, loaded, batch, engine = figures["idle"], figures["loaded"], figures["batch"], figures["engine"]
    ratios = {
        f"ttft_p50_ratio_{lvl['streams']}": loaded_lvl["ttft_p50_ms"] / lvl["ttft_p50_ms"]
        for lvl, loaded_lvl in zip(idle, loaded["levels"])
    }
    ratios["batch_vs_engine"] = batch["tokens_per_s"] / engine["tokens_per_s"]
    ratios["batch_vs_engine_per_cpu_s"] = batch["tokens_per_cpu_s"] / engine["tokens_per_cpu_s"]
    return figures | {"ratios": ratios}


def report(figures: dict, command: str) -> str:
    load = " → ".join(f"{value:.1f}" for value in figures["load_average_1min"])
    lines = [
        f"model {figures['model']}; {machine()}; load average {load}; server: `{command}`",
        "",
        "| streams | TTFT p50 idle | TTFT p50 under batch load | ratio |",
        "|---|---|---|---|",
    ]
    for idle, loaded in zip(figures["idle"], figures["loaded"]["levels"]):
        lines.append(
            f"| {idle['streams']} | {idle['ttft_p50_ms']:.0f} ms | {loaded['ttft_p50_ms']:.0f} ms | {loaded['ttft_p50_ms'] / idle['ttft_p50_ms']:.2f} |"
        )
    engine, batch = figures["engine"], figures["batch"]
    ratios = figures["ratios"]
    lines += [
        "",
        "| job | completion tokens per second | per CPU second |",
        "|---|---|---|",
        f"| the engine alone: {engine['requests']} requests at once, in process (max_seqs {figures['max_seqs']}) | {engine['tokens_per_s']:.1f} | {engine['tokens_per_cpu_s']:.1f} |",
        f"| the same requests as one batch | {batch['tokens_per_s']:.1f} ({ratios['batch_vs_engine']:.0%}) | {batch['tokens_per_cpu_s']:.1f} ({ratios['batch_vs_engine_per_cpu_s']:.0%}) |",
        f"| the load batch while interactive streams ran | {figures['loaded']['batch_tokens_per_s_meanwhile']:.1f} | |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # a SIGTERM still stops the server (it runs in a session of its own)
    logs = Path(tempfile.mkdtemp(prefix="lmq-bench-priority-logs-"))
    load = [os.getloadavg()[0]]
    engine = engine_throughput(args, 300_000)  # the batch job's questions, before the server takes the cores
    with lmq_serve(args, logs) as (base, command, pid):
        figures = with_ratios(asyncio.run(measure(args, base, pid)) | {"engine": engine, "max_seqs": args.max_seqs})
    load.append(os.getloadavg()[0])
    figures |= {
        "load_average_1min": load,
        "machine": machine(),
        "command": "python bench/service/priority.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "server": command,
    }
    print(report(figures, command))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
