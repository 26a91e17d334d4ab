"""Constrained decoding: what a JSON-schema grammar costs per step, at 16 streams, on the default model's vocabulary.

    .venv/bin/python -m bench.engine.grammar_overhead [--streams 16] [--rounds 3] [--peers DIR]

Each stream is teacher-forced through its own pretty-printed JSON document that validates against
a schema with nesting, enums, arrays and `required` (the grammar's states are those of real
output, not of random tokens). Measured per step:

1. lmq's sampler (worker/sampler.py) over [streams, 49,152] logits with the server's default
   sampling, without constraints and with a llguidance grammar on every row (mask fill, mask
   applied, draw, the matcher advanced): the overhead a constrained request adds to a step;
2. the grammar engines side by side, the same documents, each with its own batched API where it
   has one (llguidance also with its thread pool): the mask fill for all rows, the
   mask applied to the logits, the tokens consumed; and each engine's start-up (vocabulary) and
   schema compile time;
3. ways to apply a bitmask to [16, V] float32 logits on the CPU.

Each engine runs in a process of its own. Figures are wall-time medians (and minimums) in ms.

xgrammar and outlines-core are compared only if importable: install them apart from the project,
`pip install --no-deps --target DIR xgrammar apache-tvm-ffi outlines-core`, and pass `--peers DIR`
(xgrammar's declared dependencies pull CUDA torch, triton and transformers).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from protocol import SamplingParams
from worker import grammar
from worker.model.loader import load_model
from worker.sampler import SamplingState, sample
from worker.token_bytes import token_bytes

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "country": {"enum": ["FR", "DE", "US", "JP"]},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
        "pets": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["cat", "dog", "fish"]},
                    "name": {"type": "string"},
                    "age": {"type": "integer"},
                },
                "required": ["kind", "name"],
                "additionalProperties": False,
            },
        },
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "address", "pets", "tags"],
    "additionalProperties": False,
}
NAMES = [
    "Ann",
    "Bob",
    "Chloé",
    "Dmitri",
    "Eve",
    "Fatima",
    "Gustav",
    "Hiro",
    "Ines",
    "Jun",
    "Kofi",
    "Lena",
    "Mateo",
    "Nia",
    "Omar",
    "Priya",
]
OUTLINES_WHITESPACE = r"(\r?\n[\x20\x09]{0,24}|\x20)?"  # the same as worker/grammar.py's


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timed passes over the documents (after one to warm up); the median step is reported",
    )
    parser.add_argument("--peers", type=Path, help="a folder with xgrammar and outlines_core installed (pip --target)")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one of ENGINES, run in a process of its own
    return parser


def document(index: int) -> str:
    name = NAMES[index % len(NAMES)]
    doc = {
        "name": f"{name} {index}",
        "age": 20 + index,
        "role": ["admin", "editor", "viewer"][index % 3],
        "address": {"street": f"{index + 1} Rue de la Paix", "city": "Paris", "country": "FR"},
        "pets": [{"kind": "cat", "name": "Tom", "age": 3}, {"kind": "dog", "name": "Rex"}][: 1 + index % 2],
        "tags": ["vip", "beta"][: index % 3],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False)


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


class Timer:
    """Wall time of each timed part, every sample kept: figures are 'median (min)' in ms. On a
    shared machine the median grows with the neighbours' load; the minimum much less."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}

    def time(self, part: str, work: Callable[[], object]) -> object:
        started = time.perf_counter()
        result = work()
        self.wall.setdefault(part, []).append(time.perf_counter() - started)
        return result

    def clear(self) -> None:
        self.wall.clear()

    def figure(self, part: str) -> str:
        return figure(self.wall[part])


def figure(samples: list[float]) -> str:
    return f"{median_ms(samples):.2f} ({min(samples) * 1000:.2f})"


# ------------------------------------------------------------ 1. the sampler, as the engine runs it


def sampler_steps(model, docs: list[list[int]], rounds: int, timer: Timer) -> None:
    """Times `sample` + `record` per step, as the engine's torch thread runs them, with and without grammars."""
    vocab = model.config.vocab_size
    compiler = grammar.GrammarCompiler(model.tokenizer, vocab_size=vocab, stop_token_ids=model.stop_token_ids)
    constraint = {"type": "json_schema", "schema": SCHEMA}
    compiler.check(constraint)
    steps = min(len(doc) for doc in docs)
    base = torch.randn(len(docs), vocab, generator=torch.Generator().manual_seed(0)) * 3
    for round_index in range(rounds + 1):  # round 0 warms up
        if round_index == 1:
            timer.clear()
        for part in ("free", "constrained"):
            states = [
                SamplingState(
                    SamplingParams(),
                    prompt_ids=[],
                    generated_ids=[],
                    vocab_size=vocab,
                    device=torch.device("cpu"),
                    grammar=compiler.matcher(constraint) if part == "constrained" else None,
                )
                for _ in docs
            ]
            for step in range(steps):
                logits = base.clone()
                forced = [doc[step] for doc in docs]
                logits[torch.arange(len(docs)), forced] += 30.0  # the document's token wins the draw

                def work() -> list[int]:
                    tokens = sample(logits, states).tokens
                    for state, token in zip(states, tokens):
                        state.record(token)
                    return tokens

                assert timer.time(part, work) == forced, "the grammar refused a token of a valid document"


# ------------------------------------------------------------ 2. engines side by side


def run_engine(
    name: str, make: Callable[[], tuple[Callable, Callable, Callable]], docs: list[list[int]], vocab: int, rounds: int
) -> Timer:
    """make() -> (new_matchers, fill(matchers, bitmask), consume(matchers, tokens)); times each part."""
    timer = Timer()
    new_matchers, fill, consume = make()
    steps = min(len(doc) for doc in docs)
    base = torch.randn(len(docs), vocab, generator=torch.Generator().manual_seed(0))
    for round_index in range(rounds + 1):  # round 0 warms up (allocations, the engines' threads)
        if round_index == 1:
            timer.clear()
        matchers = new_matchers()
        for step in range(steps):
            bitmask = torch.full((len(docs), (vocab + 31) // 32), -1, dtype=torch.int32)
            logits = base.clone()
            timer.time("fill", lambda: fill(matchers, bitmask))
            timer.time("apply", lambda: logits.add_(grammar.mask_bias(bitmask, vocab)))  # lmq's, for every engine
            tokens = [doc[step] for doc in docs]
            assert all(torch.isfinite(logits[row, token]) for row, token in enumerate(tokens)), (
                f"{name} masked a valid token"
            )
            timer.time("consume", lambda: consume(matchers, tokens))
    return timer


def apply_variants(vocab: int, streams: int, rounds: int) -> dict[str, str]:
    """Ways to apply a [streams, V/32] bitmask to [streams, V] float32 logits on the CPU."""
    bitmask = torch.randint(
        -(2**31),
        2**31 - 1,
        (streams, (vocab + 31) // 32),
        dtype=torch.int32,
        generator=torch.Generator().manual_seed(1),
    )
    logits = torch.randn(streams, vocab)
    shifts = torch.arange(32, dtype=torch.int32)

    def unpack_and_masked_fill(x: torch.Tensor) -> None:
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(streams, -1)[:, :vocab].bool()
        x.masked_fill_(~allowed, float("-inf"))

    variants = {
        "lmq: byte-table gather, add 0/-inf": lambda x: x.add_(grammar.mask_bias(bitmask, vocab)),
        "unpack bits, masked_fill_ (llguidance.torch / outlines-core kernels, uncompiled)": unpack_and_masked_fill,
    }
    try:
        import xgrammar

        variants["xgrammar.apply_token_bitmask_inplace (its CPU kernel)"] = lambda x: (
            xgrammar.apply_token_bitmask_inplace(x, bitmask)
        )
    except ImportError:
        pass
    timer = Timer()
    for round_index in range(rounds + 1):
        if round_index == 1:
            timer.clear()
        for _ in range(100):
            for name, apply in variants.items():
                x = logits.clone()
                timer.time(name, lambda: apply(x))
    return {name: timer.figure(name) for name in variants}


def llguidance_engine(model, vocab: int, streams: int, parallel: bool = True) -> tuple[dict, Callable]:
    import llguidance

    started = time.perf_counter()
    compiler = grammar.GrammarCompiler(model.tokenizer, vocab_size=vocab, stop_token_ids=model.stop_token_ids)
    setup = time.perf_counter() - started
    constraint = {"type": "json_schema", "schema": SCHEMA}
    started = time.perf_counter()
    compiler.check(constraint)
    compile_s = time.perf_counter() - started
    executor = llguidance.LLExecutor()

    def make():
        def new_matchers():
            return [compiler.matcher(constraint)._matcher for _ in range(streams)]

        def fill(matchers, bitmask):
            row_bytes = bitmask.shape[1] * 4
            if parallel:  # llguidance's thread pool (LLExecutor)
                executor.unsafe_compute_mask_ptr(
                    [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), row_bytes, bitmask.shape[0]
                )
            else:  # one row after the other in the calling thread, as worker/grammar.py does
                for row, matcher in enumerate(matchers):
                    matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), row_bytes)

        def consume(matchers, tokens):
            for matcher, token in zip(matchers, tokens):
                assert matcher.consume_token(token)

        return new_matchers, fill, consume

    return {"setup_s": setup, "compile_s": compile_s}, make


def xgrammar_engine(model, vocab: int, streams: int) -> tuple[dict, Callable]:
    import xgrammar

    started = time.perf_counter()
    info = xgrammar.TokenizerInfo(
        token_bytes(model.tokenizer),
        xgrammar.VocabType.RAW,
        vocab_size=vocab,
        stop_token_ids=sorted(model.stop_token_ids),
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True, max_whitespace_cnt=25)
    compile_s = time.perf_counter() - started
    batch = xgrammar.BatchGrammarMatcher()

    def make():
        def new_matchers():
            return [xgrammar.GrammarMatcher(compiled) for _ in range(streams)]

        def fill(matchers, bitmask):
            batch.batch_fill_next_token_bitmask(matchers, bitmask)

        def consume(matchers, tokens):
            for matcher, token in zip(matchers, tokens):
                assert matcher.accept_token(token)

        return new_matchers, fill, consume

    return {"setup_s": setup, "compile_s": compile_s}, make


def outlines_engine(model, vocab: int, streams: int) -> tuple[dict, Callable]:
    import outlines_core

    table = token_bytes(model.tokenizer)
    eos = min(model.stop_token_ids)
    specials = set(model.tokenizer.get_added_tokens_decoder())
    started = time.perf_counter()
    entries: dict[bytes, list[int]] = {}
    for token, raw in enumerate(table):
        if raw and token not in specials:
            entries.setdefault(raw, []).append(token)
    vocabulary = outlines_core.Vocabulary(eos, entries)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA), OUTLINES_WHITESPACE)
    index = outlines_core.Index(regex, vocabulary)
    compile_s = time.perf_counter() - started

    def make():
        def new_matchers():
            return [outlines_core.Guide(index) for _ in range(streams)]

        def fill(guides, bitmask):
            words = bitmask.shape[1]
            for row, guide in enumerate(guides):  # no batched API
                guide.write_mask_into(bitmask[row].data_ptr(), words, 4)

        def consume(guides, tokens):
            for guide, token in zip(guides, tokens):
                guide.advance(token, return_tokens=False)

        return new_matchers, fill, consume

    return {"setup_s": setup, "compile_s": compile_s}, make


ENGINES = {
    "llguidance": (lambda *args: llguidance_engine(*args, parallel=False), "llguidance"),
    "llguidance, thread pool": (llguidance_engine, "llguidance"),
    "xgrammar": (xgrammar_engine, "xgrammar"),
    "outlines-core": (outlines_engine, "outlines_core"),
}


def engine_row(name: str, model, docs: list[list[int]], rounds: int) -> str:
    build, module = ENGINES[name]
    try:
        version = importlib.metadata.version(module.replace("_", "-"))
        importlib.import_module(module)
    except Exception as error:  # not installed: say so
        return f"| {name} | not importable ({type(error).__name__}); see --peers | | | | | | |"
    vocab = model.config.vocab_size
    setup, make = build(model, vocab, len(docs))
    timer = run_engine(name, make, docs, vocab, rounds)
    total = [sum(parts) for parts in zip(timer.wall["fill"], timer.wall["apply"], timer.wall["consume"])]
    return (
        f"| {name} | {version} | {setup['setup_s']:.2f} | {setup['compile_s']:.3f} | {timer.figure('fill')} | "
        f"{timer.figure('apply')} | {timer.figure('consume')} | {figure(total)} |"
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.peers:
        sys.path.insert(0, str(args.peers))
    model = load_model(None)
    vocab = model.config.vocab_size
    docs = [model.tokenizer.encode(document(i), add_special_tokens=False).ids for i in range(args.streams)]
    if args.only:  # one engine in a process of its own: no other engine's threads beside it
        print(engine_row(args.only, model, docs, args.rounds))
        return
    steps = min(len(doc) for doc in docs)
    print(f"# Constrained decoding overhead — {cpu_model()}, {torch.get_num_threads()} torch threads")
    print(
        f"model {model.name}, vocabulary {vocab}; {args.streams} streams, {steps} steps x {args.rounds} rounds; torch {torch.__version__}\n"
    )

    timer = Timer()
    sampler_steps(model, docs, args.rounds, timer)
    print(f"Wall time per step in ms, median (min); load average before: {os.getloadavg()[0]:.2f}.\n")
    print("| sampler step, 16 rows, default sampling (worker/sampler.py) | ms |")
    print("|---|---:|")
    print(f"| no constraint | {timer.figure('free')} |")
    print(f"| JSON schema on every row (llguidance) | {timer.figure('constrained')} |")
    extra = median_ms(timer.wall["constrained"]) - median_ms(timer.wall["free"])
    extra_min = (min(timer.wall["constrained"]) - min(timer.wall["free"])) * 1000
    print(f"| the grammars' cost per step | {extra:.2f} ({extra_min:.2f}) |")
    print(f"| per constrained token | {extra / args.streams:.3f} ({extra_min / args.streams:.3f}) |\n")

    print("| engine | version | start-up s | schema compile s | mask fill | mask apply (lmq's) | consume | per step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in ENGINES:
        command = [
            sys.executable,
            "-m",
            "bench.engine.grammar_overhead",
            "--only",
            name,
            "--streams",
            str(args.streams),
            "--rounds",
            str(args.rounds),
        ]
        if args.peers:
            command += ["--peers", str(args.peers)]
        done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
        print(done.stdout.strip() or f"| {name} | failed: {done.stderr.strip().splitlines()[-1:]} | | | | | | |")

    print("\n| applying the mask, [16, V] float32 on the CPU | ms |")
    print("|---|---:|")
    for name, figure in apply_variants(vocab, args.streams, args.rounds).items():
        print(f"| {name} | {figure} |")


if __name__ == "__main__":
    main()
