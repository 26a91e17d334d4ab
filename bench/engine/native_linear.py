"""The native step's linears per GGUF type: time and read bandwidth of one matrix, rows 1 and 16.

Each type's matrix is random blocks (speed does not depend on the values) packed as the native step
packs it (worker/model/native_pack.py) and run through `lmq_linear` (worker/native/quant_linear.h),
which quantizes x to int16 as a step does and multiplies on the whole team. Types alternate within
each round, so load on the machine falls on all of them alike; the figure is the median of the rounds.
GB/s is the packed matrix's bytes over the time (at 16 rows the kernel reads them once, from memory,
when the matrix does not fit the caches); the ratio is against Q4_0 (the int4 kernel) on the same shape.

    python -m bench.engine.native_linear                      # 2048x2048 and 8192x2048, rows 1 and 16, 1 thread
    python -m bench.engine.native_linear --shapes 8192x2048 --rows 1 --threads 2
    python -m bench.engine.native_linear --types Q4_0,Q4_1 --baseline main   # this tree's kernels beside main's
    python -m bench.engine.native_linear --int8 --rows 16,256                 # x in int8, as batched decodes and long prompts

With `--baseline REV`, each type also runs on REV's library (bench/engine/native_baseline.py), alternated
with this tree's inside every round; the ratio column is then REV's time over this tree's on the same type
and shape (> 1: this tree is faster).
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import statistics
import tempfile
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from bench.engine.native_baseline import baseline_library
from worker.model.gguf_blocks import FORMATS, gguf_blocks
from worker.model.native_pack import kernel_format, matrix, pack_parts
from worker.model.weights import QuantBlocks
from worker.native import build

# Byte offsets of each type's fp16 fields (d, and m or dmin), set to a normal value in the random blocks.
FP16_FIELDS = {QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2), QType.Q8_0: (0,),
               QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,), QType.Q3_K: (108,), QType.IQ4_NL: (0,),
               QType.IQ4_XS: (0,)}  # fmt: skip


def random_blocks(qtype: QType, n: int, k: int, seed: int = 0) -> QuantBlocks:
    values, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, size=(n * k // values, size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        raw[:, offset : offset + 2] = np.array([1.1e-3], dtype=np.float16).view(np.uint8)
    return gguf_blocks(raw.reshape(n, -1), qtype, n, k)


class Linear:
    def __init__(self, blocks: QuantBlocks) -> None:
        self.keep: list = []
        packed = pack_parts([blocks])
        self.struct = matrix(packed, self.keep)
        self.n, self.k = blocks.q.shape
        self.bytes = sum(part.nbytes() for part in packed)
        self.format = kernel_format(blocks)

    def run(self, library: ctypes.CDLL, x: torch.Tensor, out: torch.Tensor, threads: int, entry: str) -> None:
        status = getattr(library, entry)(ctypes.byref(self.struct), ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]),
                                         ctypes.c_void_p(out.data_ptr()), threads)  # fmt: skip
        assert status == 0


def measure(
    shapes: list[tuple[int, int]],
    rows_list: list[int],
    threads: int,
    rounds: int,
    calls: int,
    types: list[QType],
    libraries: dict[str, ctypes.CDLL],
    entry: str = "lmq_linear",
) -> None:
    # One thread: its own CPU time, blind to other processes taking the core (a loaded machine); more: wall time.
    clock = time.thread_time if threads == 1 else time.perf_counter
    print(f"threads {threads} ({clock.__name__}), median of {rounds} rounds of {calls} calls each, types alternated")
    print(
        f"{'type':5} {'library':10} {'kernel':16} {'shape':>10} {'rows':>4} {'bits/w':>6} {'µs':>8} {'GB/s':>6} {'ratio':>6}"
    )
    names = list(libraries)
    for n, k in shapes:
        linears = {qtype: Linear(random_blocks(qtype, n, k)) for qtype in types}
        for rows in rows_list:
            x, outs = torch.randn(rows, k), {name: torch.empty(rows, n) for name in names}
            seconds = {(qtype, name): [] for qtype in linears for name in names}
            for linear in linears.values():
                for name, library in libraries.items():
                    linear.run(library, x, outs[name], threads, entry)  # warm-up
            for round_ in range(rounds):
                for qtype, linear in linears.items():
                    # Each library first in every other round, and one untimed call before its timed ones:
                    # the one that ran second would find the matrix in cache (an A/A run showed 7-25%).
                    for name in names if round_ % 2 == 0 else names[::-1]:
                        library = libraries[name]
                        linear.run(library, x, outs[name], threads, entry)
                        start = clock()
                        for _ in range(calls):
                            linear.run(library, x, outs[name], threads, entry)
                        seconds[(qtype, name)].append((clock() - start) / calls)
            for qtype, linear in linears.items():
                for name in names:
                    median = statistics.median(seconds[(qtype, name)])
                    # Against Q4_0 on this tree alone; against the same type on the baseline with one.
                    base = statistics.median(
                        seconds[(qtype, names[-1])] if len(names) > 1 else seconds[(types[0], name)]
                    )
                    print(f"{qtype.name:5} {name[:10]:10} {linear.format.split(' as ')[1]:16} {f'{n}x{k}':>10} {rows:>4} "
                          f"{8 * linear.bytes / (n * k):6.2f} {median * 1e6:8.1f} {linear.bytes / median / 1e9:6.1f} "
                          f"{base / median:6.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes", default="2048x2048,8192x2048", help="n x k (output rows x input columns), comma-separated"
    )
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument(
        "--types", default=",".join(qtype.name for qtype in FORMATS), help="GGUF types, comma-separated"
    )
    parser.add_argument("--baseline", help="a git revision whose kernels to run beside this tree's")
    parser.add_argument("--int8", action="store_true", help="x in int8 per 16 values (lmq_linear_int8), not int16")
    args = parser.parse_args()
    entry = "lmq_linear_int8" if args.int8 else "lmq_linear"
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    library = build.load()
    if library is None:
        raise SystemExit(f"no native library: {build.missing_requirements()}")
    getattr(library, entry).restype = ctypes.c_int
    libraries = {"this tree": library}
    types = [QType[name] for name in args.types.split(",")]
    with tempfile.TemporaryDirectory() as directory:
        if args.baseline:
            libraries[args.baseline] = baseline_library(args.baseline, pathlib.Path(directory))
        rows = [int(r) for r in args.rows.split(",")]
        measure(shapes, rows, args.threads, args.rounds, args.calls, types, libraries, entry)


if __name__ == "__main__":
    main()
