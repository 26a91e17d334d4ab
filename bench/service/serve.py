"""Load generator for any OpenAI-compatible server: streaming chat completions at several concurrencies.

    python bench/service/serve.py --url http://127.0.0.1:8000/v1 --concurrency 1,4,16,64 \\
        --requests 64 --max-tokens 128 --ignore-eos --json bench/results/lmq.json

Each level runs a fixed number of requests (at least one per stream) from `concurrency` closed-loop
streams; every request gets a question never sent before in the run, sized to --prompt-tokens after the
chat template by asking the target itself. Reports TTFT (median, p95), TPOT (median), per-stream and
aggregate output tokens/s, requests/s and errors, as a table and as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import aiohttp

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness.client import ChatClient, is_loopback
from bench.harness.prompts import cache_safe, fit_system_words, fit_user_prompts, system_text
from bench.harness.stats import RequestResult, format_table, summarize


def int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


def _token_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    low_value, high_value = int(low), int(high or low)
    if not 0 < low_value <= high_value:
        raise argparse.ArgumentTypeError("LOW-HIGH with 0 < LOW <= HIGH")
    return low_value, high_value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="base URL of the OpenAI-compatible API")
    parser.add_argument("--model", default="", help="model name; empty = the first of GET /models")
    parser.add_argument("--api-key", default="", help="bearer token, if the target wants one")
    parser.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 64], help="levels, e.g. 1,4,16,64")
    parser.add_argument(
        "--requests", type=int, default=32, help="requests per level (at least the level's concurrency)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests before the first level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (body extension)")
    parser.add_argument("--prompt-tokens", type=_token_range, default=(50, 60), help="LOW-HIGH after the chat template")
    parser.add_argument(
        "--prompt-offset", type=int, default=0, help="index of the first question (new questions for a rerun)"
    )
    parser.add_argument(
        "--shared-prefix-tokens", type=int, default=0, help="add a system prompt of about this many tokens"
    )
    parser.add_argument("--prefix-mode", choices=["shared", "unique"], default="shared",
                        help="shared: one system prompt for all (cacheable); unique: each starts differently")  # fmt: skip
    parser.add_argument(
        "--level-timeout", type=float, default=600.0, help="seconds a level may take; the rest count as errors"
    )
    parser.add_argument(
        "--probe-timeout", type=float, default=60.0, help="seconds GET /models or one sizing probe may take"
    )
    parser.add_argument("--label", default="", help="name of this run in the JSON")
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--allow-remote", action="store_true", help="allow a target that is not on this machine")
    return parser


def level_sizes(args: argparse.Namespace) -> list[int]:
    return [max(args.requests, concurrency) for concurrency in args.concurrency]


async def build_workload(client: ChatClient, args: argparse.Namespace) -> list[list[dict[str, str]]]:
    """The message lists of the whole run, warm-up first, each with a distinct question."""
    count = args.warmup + sum(level_sizes(args))
    low, high = args.prompt_tokens
    probe = await cache_safe(client.prompt_tokens)
    users = await fit_user_prompts(count, args.prompt_offset, probe, low, high)
    if not args.shared_prefix_tokens:
        return [[{"role": "user", "content": text}] for text in users]
    words = await fit_system_words(args.shared_prefix_tokens, client.prompt_tokens)
    nonce = (lambda i: None) if args.prefix_mode == "shared" else (lambda i: args.prompt_offset + i)
    return [
        [{"role": "system", "content": system_text(words, nonce(i))}, {"role": "user", "content": text}]
        for i, text in enumerate(users)
    ]


CANCEL_GRACE_S = 5.0  # for streams cut by the level timeout to unwind; a stream that will not is left behind


async def run_level(
    client: ChatClient, bodies: list[dict], concurrency: int, timeout_s: float
) -> tuple[list[RequestResult], float]:
    """Run `bodies` from `concurrency` closed-loop streams; returns the results and the wall time.

    Bounded: after `timeout_s` the streams still running are cancelled and their requests counted as
    errors, and the cancelled streams get CANCEL_GRACE_S to unwind, no more.
    """
    pending = list(reversed(bodies))
    results: list[RequestResult] = []

    async def stream() -> None:
        while pending:
            results.append(await client.stream_chat(pending.pop(), timeout_s))

    started = time.perf_counter()
    tasks = [asyncio.create_task(stream()) for _ in range(min(concurrency, len(bodies)))]
    _, unfinished = await asyncio.wait(tasks, timeout=timeout_s)
    for task in unfinished:
        task.cancel()
    if unfinished:
        await asyncio.wait(unfinished, timeout=CANCEL_GRACE_S)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # a bug in this file, not a failed request (stream_chat records those)
    wall = time.perf_counter() - started
    cut = len(bodies) - len(results)
    results += [RequestResult(start=started, end=started + wall, error="cut by --level-timeout") for _ in range(cut)]
    return results, wall


async def run(args: argparse.Namespace) -> dict:
    if not args.allow_remote and not is_loopback(args.url):
        raise SystemExit(f"refusing non-loopback target {args.url} (pass --allow-remote to benchmark it)")
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # no stale keep-alive races
    async with aiohttp.ClientSession(connector=connector) as session:
        client = ChatClient(session, args.url, args.model, args.api_key, probe_timeout_s=args.probe_timeout)
        client.model = client.model or await client.first_model()
        workload = await build_workload(client, args)
        bodies = [client.chat_body(messages, args.max_tokens, args.ignore_eos) for messages in workload]
        warmup, bodies = bodies[: args.warmup], bodies[args.warmup :]
        if warmup:
            await run_level(client, warmup, len(warmup), args.level_timeout)
        levels = []
        print(format_table([]), file=sys.stderr, flush=True)
        for concurrency, size in zip(args.concurrency, level_sizes(args)):
            results, wall = await run_level(client, bodies[:size], concurrency, args.level_timeout)
            bodies = bodies[size:]
            levels.append(summarize(concurrency, results, wall))
            print(format_table(levels[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return {
        "label": args.label,
        "url": args.url,
        "model": client.model,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"},
        "levels": levels,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    report = asyncio.run(run(args))
    report["command"] = " ".join(["python", "bench/service/serve.py", *argv])
    print(format_table(report["levels"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if all(level["completed"] == 0 for level in report["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
