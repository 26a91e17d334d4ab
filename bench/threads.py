"""The engine's decode step on one torch thread and on all, at several batch sizes (docs/benchmarks.md, "Threads per step").

    .venv/bin/python -m bench.threads                     # the default model, rows 1..32, 1 and 2 threads
    .venv/bin/python -m bench.threads --rows 1,8 --threads 1,4

Each measurement is an `Engine` fed B requests of `--tokens` greedy tokens with the per-step thread
rule off (worker/step_threads.py), so every step runs on the thread count given; the figure is the
median gap between its last 30 steps, when all B sequences decode. The thread counts alternate,
`--rounds` times, so the host's drift hits them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker runs (worker/config.py)

import torch

from protocol import SamplingParams
from worker import compute_thread
from worker.engine import Engine, GenRequest
from worker.model.loader import LoadedModel, load_model
from worker.prompt import build_prompt_ids

MEASURED_STEPS = 30


def decode_step_ms(model: LoadedModel, rows: int, threads: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    messages = [[{"role": "user", "content": f"{index} Tell me a story about a city."}] for index in range(rows)]
    requests = [
        GenRequest(f"r{index}", build_prompt_ids(model, messages=m, max_tokens=tokens, truncate=False), params)
        for index, m in enumerate(messages)
    ]
    stamps: list[float] = []

    async def run() -> None:
        engine = Engine(model, max_seqs=max(rows, 8), on_step=lambda outputs: stamps.append(time.perf_counter()))
        engine.backend.step_threads = None
        for request in requests:
            engine.add(request)
        engine.stop()
        await engine.run()

    compute_thread.run(torch.set_num_threads, threads)
    asyncio.run(run())
    gaps = [later - earlier for earlier, later in zip(stamps[-MEASURED_STEPS - 1 : -1], stamps[-MEASURED_STEPS:])]
    return statistics.median(gaps) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model file or directory; empty = the default model")
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument(
        "--tokens", type=int, default=48, help="tokens each request generates (more than the measured steps)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model = compute_thread.run(load_model, args.model or None, dtype="auto", quant="auto", device="cpu")
    thread_counts = [int(value) for value in args.threads.split(",")]
    print(f"{model.name}, {model.dtype}/{model.quant}; median decode step, ms ({args.rounds} rounds, alternated)")
    print("rows  " + "  ".join(f"{threads} thread(s)".rjust(16) for threads in thread_counts))
    for rows in (int(value) for value in args.rows.split(",")):
        figures: dict[int, list[float]] = {threads: [] for threads in thread_counts}
        for _ in range(args.rounds):
            for threads in thread_counts:
                figures[threads].append(decode_step_ms(model, rows, threads, args.tokens))
        print(
            f"{rows:>4}  "
            + "  ".join(" / ".join(f"{ms:.1f}" for ms in figures[threads]).rjust(16) for threads in thread_counts),
            flush=True,
        )


if __name__ == "__main__":
    main()
