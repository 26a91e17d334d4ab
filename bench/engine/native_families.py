"""The native step against the torch path on a family's real shape: engine decode tok/s at 1 and 16 streams.

    .venv/bin/python -m bench.engine.native_families                      # Qwen3-0.6B's shape, random weights
    .venv/bin/python -m bench.engine.native_families --shape gemma3-270m --tokens 32 --rounds 2
    .venv/bin/python -m bench.engine.native_families --model .bench/shapes/qwen3-30b-a3b-4l-random.Q4_0.gguf
    .venv/bin/python -m bench.engine.native_families --baseline main --peers native   # this tree's step beside main's

One random-weight model (the values do not change the time) in the shape's config, written as an HF
directory in bfloat16 and loaded in the default CPU mode; then the same LoadedModel runs through the
real Engine on the cpu-torch backend and on the cpu-native one, alternated `--rounds` times (the machine's
load drifts). A figure is generated tokens per second of the decode steps, from the moment every stream
has its first token (the prompts' prefill is left out) to the last token. The native backend's
`served` counts are printed so a run that fell back to torch shows it. With `--baseline REV` a third
backend runs the same packed model on REV's native library (bench/engine/native_baseline.py), for a
before/after of the step inside one run; `--peers native` leaves the (slow) torch path out.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as the worker waits (worker/config.py); before torch loads
os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # a short spin, then sleep

import argparse
import asyncio
import math
import pathlib
import platform
import statistics
import tempfile
import time
from typing import Any

import torch

from bench.engine.native_baseline import baseline_library
from bench.engine.quality import cpu_model
from bench.engine.random_models import write_hf_dir
from protocol import SamplingParams
from worker.engine import Engine, GenRequest, SeqOutput
from worker.model.loader import LoadedModel, load_model
from worker.runtime.cpu_torch import CpuTorchBackend
from worker.runtime.select import select_backend

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    # google/gemma-3-270m
    "gemma3-270m": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=640,
                        intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=256, vocab_size=262144, max_position_embeddings=4096, rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0, query_pre_attn_scalar=256, sliding_window=512,
                        sliding_window_pattern=6, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1,
                        eos_token_id=2),
}  # fmt: skip


def model_path(model: str | None, shape: str, directory: pathlib.Path) -> str:
    """A bench's model: the GGUF file `model`, else the shape's random-weight HF directory written under `directory`."""
    if model:
        return model
    return str(write_hf_dir(directory / "model", SHAPES[shape], random_weights(SHAPES[shape])))


def model_label(model: str | None, shape: str) -> str:
    """What a bench's report names its model: the GGUF file's name, else the shape's."""
    return pathlib.Path(model).name if model else f"{shape} shape, random weights"


def random_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named tensors of the shape (q/k norms for Qwen3 and Gemma 3, Gemma's four norms a layer)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) / math.sqrt(cols)

    gemma = config["model_type"].startswith("gemma")
    norm = torch.zeros if gemma else torch.ones  # Gemma's norms hold w of x * (1 + w)
    weights = {"model.embed_tokens.weight": torch.randn(config["vocab_size"], hidden, generator=generator) * 0.05}
    weights["model.norm.weight"] = norm(hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": linear(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": norm(head_dim),
            p + "self_attn.k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
        }
        if gemma:
            weights[p + "pre_feedforward_layernorm.weight"] = norm(hidden)
            weights[p + "post_feedforward_layernorm.weight"] = norm(hidden)
    return weights


async def decode_tok_s(loaded: LoadedModel, backend, streams: int, tokens: int, salt: int) -> float:
    """Generated tokens per second of the decode steps of `streams` greedy requests run together."""
    firsts: dict[str, float] = {}  # when each stream got its first token
    finished: set[str] = set()
    counted, last = 0, 0.0  # tokens generated once every stream had its first, and when the last came
    done = asyncio.Event()

    def on_step(outputs: list[SeqOutput]) -> None:
        nonlocal counted, last
        now = time.perf_counter()
        all_started = len(firsts) == streams
        for output in outputs:
            if all_started:
                counted += len(output.token_ids)
            firsts.setdefault(output.id, now)
            if output.finish_reason:
                finished.add(output.id)
        last = now
        if len(finished) == streams:
            done.set()

    await run_greedy(Engine(loaded, on_step=on_step, backend=backend), streams, tokens, salt, done)
    return counted / (last - max(firsts.values()))


async def run_greedy(engine: Engine, streams: int, tokens: int, salt: int, done: asyncio.Event) -> None:
    """Run `engine` on `streams` greedy requests of `tokens` tokens (32-token prompts, distinct per `salt`
    so no round reuses another's prefix cache) until `done` is set, then stop it."""
    task = asyncio.create_task(engine.run())
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        engine.add(GenRequest(f"r{i}", [(salt * 7919 + i * 104729 + j) % 1000 + 3 for j in range(32)], params))
    await done.wait()
    engine.stop()
    await task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--model", help="a GGUF file instead of the shape (bench/service/shapes.py writes them)")
    parser.add_argument("--tokens", type=int, default=48, help="generated per stream")
    parser.add_argument("--streams", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", help="a git revision whose native library runs beside this tree's")
    parser.add_argument("--peers", choices=["torch", "native"], default="torch", help="native: no torch path")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:  # the native step packs its weights from the files
        path = model_path(args.model, args.shape, pathlib.Path(directory))
        loaded = load_model(path, device="cpu")  # the default mode: bfloat16, int4, native steps
        run(loaded, args, pathlib.Path(directory))


def run(loaded: LoadedModel, args: argparse.Namespace, directory: pathlib.Path) -> None:
    threads = torch.get_num_threads()
    backends = {} if args.peers == "native" else {"torch": CpuTorchBackend(loaded, threads)}
    backends["native"] = select_backend(loaded, max_threads=threads)
    assert backends["native"].name == "cpu-native", "the native step does not serve this shape"
    if args.baseline:
        baseline = backends[f"native@{args.baseline}"] = select_backend(loaded, max_threads=threads)
        baseline.native.library = baseline_library(args.baseline, directory)
    figures: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        names = list(backends) if round_ % 2 == 0 else list(backends)[::-1]  # each first in turn
        for name in names:
            for streams in args.streams:
                rate = asyncio.run(decode_tok_s(loaded, backends[name], streams, args.tokens, salt=round_))
                figures.setdefault((name, streams), []).append(rate)
                print(f"round {round_ + 1} {name:12s} {streams:2d} streams: {rate:7.1f} tok/s", flush=True)
    cpu = cpu_model()
    print(
        f"\n{model_label(args.model, args.shape)}, default CPU mode, {threads} threads, {cpu or platform.processor()}"
    )
    print(f"native steps served: {dict(backends['native'].served)}")
    peers = [name for name in backends if name != "native"]
    for streams in args.streams:
        rates = {name: statistics.median(figures[(name, streams)]) for name in backends}
        against = "  ".join(f"{name} {rate:7.1f}" for name, rate in rates.items())
        ratios = ", ".join(f"native / {peer}: {rates['native'] / rates[peer]:.2f}x" for peer in peers)
        print(f"{streams:2d} streams: {against} tok/s  ({ratios})")


if __name__ == "__main__":
    main()
