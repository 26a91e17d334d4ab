"""The native step alone on a family's real shape, this tree's kernels against another revision's: ms per decode step and where it goes.

    .venv/bin/python -m bench.engine.native_step_ab --baseline main          # Qwen3-0.6B's shape, 1 and 16 rows
    .venv/bin/python -m bench.engine.native_step_ab --rows 1,8,16 --context 200 --rounds 5

One random-weight model in the shape (bench/engine/native_families.py's configs, loaded in the default CPU
mode, so packed as the worker packs it), its sequences prefilled to `--context` tokens; then decode steps
of each row count, timed call by call, on this tree's library and on `--baseline`'s (its
worker/native sources at that git revision, compiled with the same flags into a temporary directory),
the two alternated inside every round so that load on the machine falls on both alike. Each step starts
from the same pool (the new K/V of a timed step lands in the slot after the context, overwritten by the
next), so both libraries run the same arithmetic; their logits are compared, bit for bit, and the step's
phase clock (native_step.PHASES) says where the milliseconds went. The engine's own figure (tokens per
second through the real Engine) is native_families.py's; this one isolates the step.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as the worker waits (worker/config.py); before torch loads
os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # a short spin, then sleep

import argparse
import ctypes
import pathlib
import statistics
import tempfile
import time

import torch

from bench.engine.native_baseline import baseline_library, bit_difference, embedding_table_for_baselines
from bench.engine.native_families import SHAPES, model_label, model_path
from bench.engine.quality import cpu_model
from tests.support.paged_steps import Chunk, allocate_kv, make_batch
from worker.model.loader import load_model
from worker.runtime.cpu_native import CpuNativeBackend
from worker.runtime.native_step import PHASES
from worker.runtime.select import select_backend

PAGE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--model", help="a GGUF file instead of the shape (bench/service/shapes.py writes them)")
    parser.add_argument("--baseline", help="a git revision whose worker/native sources to compare with")
    parser.add_argument("--int16", action="store_true", help="also this tree with int8 x off (every step int16 x)")
    parser.add_argument(
        "--int8-from", type=int, help="decode rows from which this tree takes int8 x (the worker's: INT8_FROM_ROWS)"
    )
    parser.add_argument("--rows", default="1,16", help="decode rows (sequences) a step, comma-separated")
    parser.add_argument("--context", type=int, default=64, help="tokens in each sequence's cache before the step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps a round, per library and row count")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="the step's team (1: timed by CPU time)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        loaded = load_model(model_path(args.model, args.shape, pathlib.Path(directory)), device="cpu")
        backend = select_backend(loaded, max_threads=torch.get_num_threads())
        assert isinstance(backend, CpuNativeBackend), "the native step does not serve this shape"
        int8_from_rows = backend.native.struct.int8_from_rows if args.int8_from is None else args.int8_from
        libraries = {"this tree": (backend.native.library, int8_from_rows)}
        if args.int16:
            libraries["int16 x"] = (backend.native.library, 0)
        if args.baseline:
            libraries[args.baseline] = (baseline_library(args.baseline, pathlib.Path(directory)), int8_from_rows)
            table = embedding_table_for_baselines(backend.native, loaded.model)  # noqa: F841 (alive for the run)
        run(backend, libraries, [int(r) for r in args.rows.split(",")], args)


def run(backend: CpuNativeBackend, libraries: dict[str, ctypes.CDLL], rows_list: list[int], args) -> None:
    native = backend.native
    native.threads = args.threads
    # One thread runs the step on this one (lmq_step), so its CPU time is blind to other processes on the core.
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    most = max(rows_list)
    per_seq = -(-(args.context + 1) // PAGE)
    kv = allocate_kv(backend.config, num_pages=per_seq * most, page_size=PAGE, dtype=torch.bfloat16)
    pages = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(most)]
    generator = torch.Generator().manual_seed(0)
    for i in range(most):  # one sequence at a time: prefill steps under max_rows tokens stay native
        prompt = torch.randint(3, 1000, (args.context,), generator=generator).tolist()
        for start in range(0, args.context, 32):
            backend.forward(make_batch([Chunk(prompt[start : start + 32], start, pages[i])], PAGE), kv)
    batches = {
        rows: make_batch([Chunk([5 + i], args.context, pages[i]) for i in range(rows)], PAGE) for rows in rows_list
    }
    times = {(name, rows): [] for name in libraries for rows in rows_list}
    phases = {(name, rows): torch.zeros(len(PHASES), dtype=torch.float64) for name in libraries for rows in rows_list}
    logits = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for rows in rows_list:
            for name in list(libraries) if round_ % 2 == 0 else list(libraries)[::-1]:  # each first in turn
                native.library, native.struct.int8_from_rows = libraries[name]
                native.phase_seconds = phases[(name, rows)] if round_ else None
                for _ in range(args.steps):
                    start = clock()
                    out = native.forward(batches[rows], kv)
                    if round_:
                        times[(name, rows)].append(clock() - start)
                logits[(name, rows)] = out
    (native.library, native.struct.int8_from_rows), native.phase_seconds = libraries["this tree"], None
    report(libraries, rows_list, times, phases, logits, args)


def report(libraries, rows_list, times, phases, logits, args) -> None:
    cpu = cpu_model()
    print(f"\n{model_label(args.model, args.shape)}, default CPU mode, {args.threads} threads, {cpu}")
    print(
        f"decode steps at context {args.context}, median of {args.rounds} rounds x {args.steps} steps; load {os.getloadavg()}"
    )
    names = list(libraries)
    print(f"{'ms per step':28s}" + "".join(f"{f'{name} x{rows}':>18s}" for rows in rows_list for name in names))
    print(f"{'whole step (median)':28s}" + "".join(
        f"{statistics.median(times[(name, rows)]) * 1e3:18.2f}" for rows in rows_list for name in names))  # fmt: skip
    for index, phase in enumerate(PHASES):
        print(f"{phase[:28]:28s}" + "".join(
            f"{phases[(name, rows)][index].item() * 1e3 / len(times[(name, rows)]):18.2f}" for rows in rows_list for name in names))  # fmt: skip
    for rows in rows_list:
        first = logits[(names[0], rows)]
        for name in names[1:]:
            print(f"x{rows} logits, {names[0]} vs {name}: {bit_difference(first, logits[(name, rows)])}")


if __name__ == "__main__":
    main()
