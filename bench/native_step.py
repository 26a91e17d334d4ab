"""The native step against the torch step it replaces, and where the native step's milliseconds go.

The native step is timed twice: as the default `--cpu-steps native` runs it (AMX tiles from
AMX_FROM_ROWS rows where the CPU has them) and all on VNNI, as `--cpu-steps invariant` runs it.

    .venv/bin/python -m bench.native_step                       # decode batches 1, 4, 16 at context 64; a 36-token prompt
    .venv/bin/python -m bench.native_step --batches 16 --context 1100 --shared 1008 --prompt 0

The default model in the default CPU mode (bfloat16/int4, `quant auto`), outside the engine: one step of
`batch` decodes with `context` tokens each in the paged KV pool, and one prompt chunk of `--prompt`
tokens after a cached page (as the service's bench prompts are: 52 tokens, 16 of them cached). Each
shape runs on the torch path and on the native one in turn, rounds alternated so that the host's drift
hits both alike; figures are medians. The native step's own phase clock (worker/native/llama_step.cpp:
thread 0 reads the time at every barrier) splits its time into phases.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker runs (worker/config.py); before torch loads
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

import argparse
import statistics
import time

import torch

from bench.quality import cpu_model
from worker.batch import PagedKV, StepBatch
from worker.model.loader import load_model
from worker.model.native_llama import PHASES

PAGE = 16


def decode_batch(batch: int, context: int, shared: int = 0) -> StepBatch:
    """`shared` leading tokens (whole pages) in pages every row shares, as a cached system prompt's."""
    pages, common = -(-context // PAGE), shared // PAGE
    own = torch.arange(batch * (pages - common)).view(batch, pages - common) + common
    tables = torch.cat((torch.arange(common).expand(batch, common), own), dim=1)
    position = context - 1
    return StepBatch(
        input_ids=torch.full((batch,), 42), positions=torch.full((batch,), position),
        slots=tables[:, position // PAGE] * PAGE + position % PAGE, query_lens=[1] * batch,
        context_lens=[context] * batch, page_tables=tables, logits_indices=torch.arange(batch),
    )  # fmt: skip


def prompt_batch(tokens: int, cached: int) -> StepBatch:
    pages = -(-(cached + tokens) // PAGE)
    positions = torch.arange(cached, cached + tokens)
    return StepBatch(
        input_ids=torch.arange(100, 100 + tokens), positions=positions, slots=positions, query_lens=[tokens],
        context_lens=[cached + tokens], page_tables=torch.arange(pages)[None, :], logits_indices=torch.tensor([tokens - 1]),
    )  # fmt: skip


def median_ms(model, batch: StepBatch, kv: PagedKV, steps: int) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        model(batch, kv)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--shared", type=int, default=0, help="leading tokens of the context every decode shares")
    parser.add_argument(
        "--prompt", type=int, default=36, help="a prompt chunk of this many tokens after one cached page; 0: none"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(dtype="auto", quant="auto", device="cpu")
    model, native = loaded.model, loaded.model.native_steps
    if native is None:
        raise SystemExit("no native step on this machine (see the log): nothing to compare")
    config = loaded.config
    shared = f" ({args.shared} shared)" if args.shared else ""
    shapes = [
        (f"decode ×{b}, context {args.context}{shared}", decode_batch(b, args.context, args.shared))
        for b in map(int, args.batches.split(","))
    ]
    if args.prompt:
        shapes.append((f"prompt chunk of {args.prompt} after {PAGE} cached", prompt_batch(args.prompt, PAGE)))
    pages = max(int(batch.page_tables.max()) + 1 for _, batch in shapes)
    shape = (config.num_layers, pages, PAGE, config.num_kv_heads, config.head_dim)
    kv = PagedKV(k=torch.randn(shape).to(torch.bfloat16), v=torch.randn(shape).to(torch.bfloat16))
    print(
        f"{cpu_model()}, {os.cpu_count()} cores, {args.threads} threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'step':42} {'torch ms':>9} {'native ms':>10} {'speed-up':>9} {'invariant ms':>13}")
    tiles_from = native.struct.amx_from_rows
    for label, batch in shapes:
        timings: dict[str, list[float]] = {"torch": [], "native": [], "invariant": []}
        phases = torch.zeros(len(PHASES), dtype=torch.float64)
        for _ in range(args.rounds):
            model.native_steps = None
            model(batch, kv)
            timings["torch"].append(median_ms(model, batch, kv, args.steps))
            model.native_steps = native
            model(batch, kv)
            native.phase_seconds = phases
            timings["native"].append(median_ms(model, batch, kv, args.steps))
            native.phase_seconds = None
            native.struct.amx_from_rows = 0
            model(batch, kv)
            timings["invariant"].append(median_ms(model, batch, kv, args.steps))
            native.struct.amx_from_rows = tiles_from
        torch_ms, native_ms, invariant_ms = (
            statistics.median(timings[path]) for path in ("torch", "native", "invariant")
        )
        print(f"{label:42} {torch_ms:9.1f} {native_ms:10.1f} {torch_ms / native_ms:8.1f}× {invariant_ms:13.1f}")
        per_step = phases / (args.rounds * args.steps) * 1000
        print(
            "    native phases, ms per step (mean): "
            + ", ".join(f"{name} {ms:.2f}" for name, ms in zip(PHASES, per_step.tolist()))
        )


if __name__ == "__main__":
    main()
