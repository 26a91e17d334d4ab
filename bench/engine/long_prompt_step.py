"""One long prompt through the step alone: its time to first token by path, and where the native step's time goes.

    .venv/bin/python -m bench.engine.long_prompt_step                          # Qwen3-0.6B's shape, 1,000 tokens
    .venv/bin/python -m bench.engine.long_prompt_step --model .bench/shapes/llama-3.2-1b-random.Q4_0.gguf --tokens 2000

A random-weight model in the shape (bench/engine/native_families.py's configs; the values do not change the
time), or a GGUF file (--model: its own blocks, as the worker packs them), reads one prompt of --tokens tokens in chunks of --chunk (the engine's token budget: `--step-tokens`),
each path into its own pool, alternated inside every round:

- `torch`: `--cpu-steps torch`, the default mode's packed bfloat16 copies for steps of 128 rows or more;
- `native int16`: the native step with int8 x off (every row int16);
- `native`: the worker's default (worker/runtime/long_prompts.py: every row but the sampled one on int8 x
  where the CPU has no AMX tiles);
- with `--baseline REV`, `REV native`: the same with REV's worker/native sources (bench/engine/native_baseline.py),
  its first-token logits and its final K/V pool compared with this tree's bit for bit.

It prints each path's seconds per prompt (the sum of its chunks' steps; median of the rounds) and the native
paths' phase clock (worker/runtime/native_step.PHASES), and how far each path's first-token logits are
from torch's (KL, and whether the top token agrees).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as the worker waits (worker/config.py); before torch loads
os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # a short spin, then sleep

import argparse
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
from worker.runtime.native_step import PHASES
from worker.runtime.select import select_backend

PAGE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--model", help="a GGUF file instead of the shape (bench/service/shapes.py writes them)")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=512, help="tokens a step (the worker's --step-tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a git revision whose worker/native sources to compare with")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as directory:
        path = model_path(args.model, args.shape, pathlib.Path(directory))
        torch_backend = select_backend(load_model(path, device="cpu", cpu_steps="torch"), max_threads=threads)
        native_loaded = load_model(path, device="cpu")
        native_backend = select_backend(native_loaded, max_threads=threads)
        native = native_backend.native
        ours = native.library
        paths = {
            "torch": (torch_backend, None, None),
            "native int16": (native_backend, 0, ours),
            "native": (native_backend, native.struct.int8_from_rows, ours),
        }
        if args.baseline:
            theirs = baseline_library(args.baseline, pathlib.Path(directory))
            table = embedding_table_for_baselines(native, native_loaded.model)  # noqa: F841 (alive for the run)
            paths[f"{args.baseline} native"] = (native_backend, native.struct.int8_from_rows, theirs)
        prompt = torch.randint(3, 1000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        pages = list(range(-(-args.tokens // PAGE)))
        times = {name: [] for name in paths}
        phases = {name: torch.zeros(len(PHASES), dtype=torch.float64) for name in paths}
        logits, pools = {}, {}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for name, (backend, int8_from_rows, library) in paths.items():
                kv = allocate_kv(backend.config, num_pages=len(pages), page_size=PAGE, dtype=torch.bfloat16)
                if library is not None:
                    native.library, native.struct.int8_from_rows = library, int8_from_rows
                    native.phase_seconds = phases[name] if round_ else None
                started = time.perf_counter()
                for start in range(0, args.tokens, args.chunk):
                    end = min(start + args.chunk, args.tokens)
                    batch = make_batch([Chunk(prompt[start:end], start, pages, samples=end == args.tokens)], PAGE)
                    out = backend.forward(batch, kv)
                if round_:
                    times[name].append(time.perf_counter() - started)
                logits[name], pools[name] = out[0], kv
        native.library, native.phase_seconds = ours, None
    report(args, times, phases, logits)
    if args.baseline:
        compare_bits(logits, pools, "native", f"{args.baseline} native")


def report(args, times, phases, logits) -> None:
    cpu = cpu_model()
    print(f"\n{model_label(args.model, args.shape)}, a {args.tokens}-token prompt in chunks of {args.chunk}, "
          f"{torch.get_num_threads()} threads, {cpu}; median of {args.rounds} rounds; load {os.getloadavg()}")  # fmt: skip
    base = logits["torch"].log_softmax(-1)
    for name, seconds in times.items():
        other = logits[name].log_softmax(-1)
        kl = float((base.exp() * (base - other)).sum())
        same = bool(logits[name].argmax() == logits["torch"].argmax())
        print(f"{name:14s} {statistics.median(seconds):7.2f} s   first token vs torch: KL {kl:.2g}, same top {same}")
    native_paths = [name for name in phases if name != "torch"]
    print(f"\n{'ms per prompt':28s}" + "".join(f"{name[-20:]:>22s}" for name in native_paths))
    for index, phase in enumerate(PHASES):
        row = "".join(f"{phases[name][index].item() * 1e3 / args.rounds:22.0f}" for name in native_paths)
        print(f"{phase[:28]:28s}{row}")


def compare_bits(logits, pools, ours: str, theirs: str) -> None:
    """Whether two libraries computed the same prompt alike: first-token logits and every K/V they wrote."""
    for what, a, b in (
        ("first-token logits", logits[ours], logits[theirs]),
        ("K pool", pools[ours].k, pools[theirs].k),
        ("V pool", pools[ours].v, pools[theirs].v),
    ):
        print(f"{what}, {ours} vs {theirs}: {bit_difference(a, b)}")


if __name__ == "__main__":
    main()
