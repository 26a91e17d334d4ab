"""The queue's own cost: gateway + Redis + worker with a model that answers at once.

    python bench/service/queue_overhead.py --streams 64,256 --json bench/results/queue_overhead.json

Starts an embedded Redis, one `lmq gateway` process and one stub worker (bench/harness/stub_worker.py),
then measures (1) streamed tokens/s at each level of concurrent streams, with the CPU seconds the
gateway, worker, Redis and this client spent, and (2) the first-token latency of one request at a
time through HTTP and the queue, against the same stub engine called in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness.client import ChatClient
from bench.harness.prompts import question
from bench.harness.stats import summarize
from bench.harness.stub_services import StubServices
from bench.service.serve import run_level


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="64,256", help="concurrent streams per level")
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens streamed per request")
    parser.add_argument("--ttft-requests", type=int, default=50, help="one-at-a-time requests for first-token latency")
    parser.add_argument("--kv-memory", default="2GiB", help="stub worker's KV budget (pages are allocated as usual)")
    parser.add_argument("--logs", type=Path, default=Path("bench/results/logs"))
    parser.add_argument(
        "--api-key",
        default="",
        help="start the gateway with this one API key (LMQ_API_KEYS) and send it: per-key checks on the hot path",
    )
    parser.add_argument("--json", type=Path)
    return parser


def messages(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": question(index)}]


async def streaming_levels(services: StubServices, args: argparse.Namespace) -> list[dict]:
    levels = []
    first_prompt = args.ttft_requests
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        client = ChatClient(session, services.url, api_key=API_KEY[0])
        client.model = await client.first_model()
        for streams in [int(s) for s in args.streams.split(",")]:
            count = streams * args.requests_per_stream
            bodies = [client.chat_body(messages(first_prompt + i), args.max_tokens, True) for i in range(count)]
            first_prompt += count
            before = services.cpu()
            results, wall = await run_level(client, bodies, streams, timeout_s=600)
            after = services.cpu()
            level = summarize(streams, results, wall)
            level["cpu_s"] = {name: after[name] - before[name] for name in after}
            level["tokens_per_gateway_cpu_s"] = level["output_tokens"] / max(level["cpu_s"]["gateway"], 1e-9)
            levels.append(level)
            print(_level_line(level), file=sys.stderr, flush=True)
    return levels


async def service_first_tokens(services: StubServices, count: int) -> list[float]:
    """TTFT of `count` requests sent one at a time through HTTP, gateway, Redis and worker."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        client = ChatClient(session, services.url, api_key=API_KEY[0])
        client.model = await client.first_model()
        bodies = [client.chat_body(messages(i), 1, True) for i in range(count)]
        results, _ = await run_level(client, bodies, 1, timeout_s=300)
    return [r.ttft for r in results if r.ok]


async def engine_first_tokens(count: int) -> list[float]:
    """TTFT of the same prompts through the stub engine in this process: template, tokenize, add, first step."""
    from bench.harness.stub_worker import load_stub
    from protocol import SamplingParams
    from worker.config import WorkerConfig
    from worker.engine import Engine, GenRequest
    from worker.prompt import build_prompt_ids

    model = await asyncio.to_thread(load_stub, WorkerConfig())
    waiting: dict[str, asyncio.Future] = {}

    def on_step(outputs) -> None:
        for output in outputs:
            future = waiting.get(output.id)
            if future and not future.done() and (output.token_ids or output.finish_reason):
                future.set_result(time.perf_counter())

    engine = Engine(model, on_step=on_step)
    runner = asyncio.create_task(engine.run())
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first_tokens = []
    for i in range(count):
        started = time.perf_counter()
        first_token = waiting[str(i)] = asyncio.get_running_loop().create_future()
        ids = build_prompt_ids(model, messages=messages(i), max_tokens=1, truncate=False)
        engine.add(GenRequest(id=str(i), prompt_ids=ids, sampling=sampling))
        first_tokens.append(await first_token - started)
        del waiting[str(i)]
    engine.stop()
    await runner
    return first_tokens


def _level_line(level: dict) -> str:
    return (
        f"{level['concurrency']:>4} streams: {level['output_tok_s']:>8.0f} tok/s, {level['completed']} ok, "
        f"{level['errors']} errors; gateway {level['cpu_s']['gateway']:.1f} CPU-s "
        f"= {level['tokens_per_gateway_cpu_s']:.0f} tok per gateway CPU-s"
    )


def _median_ms(values: list[float]) -> float | None:
    return statistics.median(values) * 1000 if values else None


API_KEY = [""]  # the key the clients send (--api-key)


async def run(args: argparse.Namespace) -> dict:
    if args.api_key:  # the gateway process reads its settings from the environment too
        os.environ["LMQ_API_KEYS"] = API_KEY[0] = args.api_key
    engine_ttft = await engine_first_tokens(args.ttft_requests)
    with StubServices(args.kv_memory, args.logs) as services:
        service_ttft = await service_first_tokens(services, args.ttft_requests)
        levels = await streaming_levels(services, args)
    engine_ms, service_ms = _median_ms(engine_ttft), _median_ms(service_ttft)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "ttft": {
            "requests": args.ttft_requests,
            "engine_in_process_median_ms": engine_ms,
            "through_queue_median_ms": service_ms,
            "added_median_ms": None if engine_ms is None or service_ms is None else service_ms - engine_ms,
            "through_queue_ok": len(service_ttft),
        },
        "levels": levels,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    report = asyncio.run(run(args))
    report["command"] = " ".join(["python", "bench/service/queue_overhead.py", *argv])
    ttft = report["ttft"]
    print(f"first token: engine in-process {ttft['engine_in_process_median_ms']:.2f} ms, through the queue "
          f"{ttft['through_queue_median_ms']:.2f} ms (median of {ttft['requests']})")  # fmt: skip
    for level in report["levels"]:
        print(_level_line(level))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
