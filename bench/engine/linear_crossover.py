"""How long one layer's linears take per weight kind and row count on this CPU: int4, int8, packed bfloat16.

    .venv/bin/python -m bench.engine.linear_crossover            # the default model's layer shapes
    .venv/bin/python -m bench.engine.linear_crossover --hidden 2048 --intermediate 8192 --heads 32 --kv-heads 8 --head-dim 64

Which weights are fastest depends on the CPU and on how many rows a step multiplies. The int4 and
int8 kernels read half or a quarter of the bytes of bfloat16 weights but dequantize them again for
every few rows, so they win at one to a few rows and lose at many; oneDNN's packed bfloat16 GEMM
(AMX where the CPU has it) reads its weights once for any number of rows. This measures one layer's
linear shapes, random weights, each candidate at 1 to 32 rows, best of a few runs, on one thread and
timed by that thread's CPU time, so that other processes on the cores do not decide it.

It was the worker's start-up choice for `--quant auto` (int4 or int8, and the row count from which
dense copies take over), kept off because a prefill on dense copies meets bfloat16/none's near-tie on
the default model's first answer; the worker now uses dense copies from loader.DENSE_FROM_ROWS rows
only, and this stays as the measurement behind that figure (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from worker.model.config import ModelConfig
from worker.model.dense_copies import dense_copies_fit
from worker.model.quant_linear import (
    Int4Linear,
    Int8Linear,
    PackedLinear,
    int4_supported,
    quantize_int4,
)

ROWS = (1, 2, 4, 8, 12, 16, 24, 32)
INT8_MARGIN = 0.9  # int8 replaces int4 only when it takes less than this share of int4's time at one row
# Dense weights take over where they need at most this share of the quantized weights' time. The measurement runs
# with the weights in cache; inside a model the dense weights, 3-4x the bytes, come from further away (measured in a
# decode step on the Intel machine: dense took 1.04-1.2x the time of int4 at 8 rows, 0.8-0.9x at 16, 0.5x at 64).
DENSE_MARGIN = 0.7
MEASURED_ROWS_CAP = 2048  # output rows of each measured shape: the time per row is what counts, not the model's size


@dataclass(frozen=True)
class WeightChoice:
    quant: str  # the weights of small steps: int4 or int8
    dense_from_rows: int | None  # steps of this many rows or more run on packed dense copies; None: never
    micros: dict[str, dict[int, float]]  # measured µs of one layer's linears, per candidate and rows

    def describe(self) -> str:
        dense = f", packed bfloat16 from {self.dense_from_rows} rows" if self.dense_from_rows else ""
        table = "; ".join(
            f"{mode} " + " ".join(f"{rows}:{us:.0f}" for rows, us in times.items())
            for mode, times in self.micros.items()
        )
        return f"{self.quant} weights for small steps{dense} (µs per layer by rows: {table})"


def layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one layer's fused linears: q/k/v, o, gate/up, down (an expert's, for mixtures of experts)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, intermediate = config.hidden_size, config.intermediate_size
    return [(q + 2 * kv, hidden), (hidden, q), (2 * intermediate, hidden), (hidden, intermediate)]


def choose_cpu_weights(config: ModelConfig, dtype: torch.dtype, dense_bytes: int) -> WeightChoice:
    """dense_bytes: what packed dense copies of every linear would take (no dense candidate when they do not fit)."""
    device = torch.device("cpu")
    shapes = [(min(n, MEASURED_ROWS_CAP), k) for n, k in layer_shapes(config)]
    candidates = {"int8": _layer(shapes, "int8", dtype)}
    if all(int4_supported(shape, device) for shape in shapes):
        candidates["int4"] = _layer(shapes, "int4", dtype)
    if dense_copies_fit(dtype, dense_bytes):
        candidates["dense"] = _layer(shapes, "dense", dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # one thread's CPU time: blind to other processes on the cores, which stall parallel kernels
    try:
        micros = {mode: {rows: _time(layer, rows, dtype) for rows in ROWS} for mode, layer in candidates.items()}
    finally:
        torch.set_num_threads(threads)
    quant = "int4" if "int4" in micros and micros["int8"][1] >= INT8_MARGIN * micros["int4"][1] else "int8"
    dense_from = None
    if "dense" in micros:
        dense_from = next((rows for rows in ROWS if micros["dense"][rows] <= DENSE_MARGIN * micros[quant][rows]), None)
    return WeightChoice(quant=quant, dense_from_rows=dense_from, micros=micros)


def _layer(shapes: list[tuple[int, int]], mode: str, dtype: torch.dtype) -> list[tuple[torch.nn.Module, int]]:
    """One layer's linears in `mode` from random weights, each with its input width."""
    generator = torch.Generator().manual_seed(0)
    layer = []
    for n, k in shapes:
        weight = torch.randn(n, k, generator=generator) * 0.02
        if mode == "int4":
            module: torch.nn.Module = Int4Linear(quantize_int4(weight), None, dtype)
        elif mode == "int8":
            module = Int8Linear(weight, None, dtype)
        else:
            module = PackedLinear(weight.to(dtype), None)
        layer.append((module, k))
    return layer


def _time(layer: list[tuple[torch.nn.Module, int]], rows: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """Best of `repeats` runs of the layer's linears on `rows` rows, in µs."""
    inputs = [(module, torch.randn(rows, width, dtype=dtype)) for module, width in layer]
    best = float("inf")
    with torch.inference_mode():
        for module, x in inputs:
            module(x)  # warm-up: first-call allocations and oneDNN primitive creation
        for _ in range(repeats):
            start = time.thread_time()
            for module, x in inputs:
                module(x)
            best = min(best, time.thread_time() - start)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64)  # SmolLM2-135M, the default model
    for name, default in shape.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    args = parser.parse_args()
    config = ModelConfig(
        vocab_size=64, hidden_size=args.hidden, intermediate_size=args.intermediate, num_layers=1,
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, max_context=128,
    )  # fmt: skip
    print(
        choose_cpu_weights(
            config, torch.bfloat16, dense_bytes=0 if dense_copies_fit(torch.bfloat16, 0) else 1 << 62
        ).describe()
    )


if __name__ == "__main__":
    main()
