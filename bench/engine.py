"""Engine benchmark on the default model: decode, prefill, prefix-cache TTFT, and one decode step's breakdown.

    .venv/bin/python -m bench.engine --threads 2 --modes float32/none bfloat16/none float32/int8 float32/int4

Prints, per weight mode (dtype/quant): decode tok/s at batch 1 and 32, prefill tok/s of a 512-token
prompt, time to first token of a 1,024-token prompt cold and with its first 1,000 tokens cached,
and where the time of one decode step goes. A peer (e.g. HF transformers' generate) slots in as
another `Figures` row: `print_table` takes any number of named rows.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, fields

import torch

import worker.model.llama as llama
from protocol import SamplingParams
from worker.engine import Engine, GenRequest, SeqOutput, build_step_batch
from worker.model.loader import LoadedModel, load_model
from worker.sampler import sample

DECODE_TOKENS = 64
BATCH = 32


@dataclass
class Figures:
    decode_1: float  # tok/s, one stream
    decode_32: float  # aggregate tok/s, 32 streams
    prefill_512: float  # prompt tok/s
    ttft_cold_1024: float  # seconds
    ttft_cached_1024: float  # seconds, first 1,000 tokens cached


@dataclass
class StepBreakdown:
    batch: int
    schedule_ms: float
    build_batch_ms: float
    model_ms: float
    attention_ms: float  # inside model_ms: KV writes, gathers and attention
    sampling_ms: float
    bookkeeping_ms: float  # scheduler completion, detokenization, stop checks


def prompt_ids(model: LoadedModel, length: int, salt: int = 0) -> list[int]:
    """`length` token ids of plain text, different per salt from the first token on."""
    text = f"Note {salt}: " + " ".join(f"the item {salt}-{i} is on the shelf." for i in range(length))
    return model.tokenizer.encode(text, add_special_tokens=False).ids[:length]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class EngineSession:
    """One running engine (and its prefix cache) shared by several timed runs."""

    def __init__(self, model: LoadedModel) -> None:
        self.engine = Engine(model, on_step=self._on_step)
        self._times: dict[str, list[float]] = {}
        self._unfinished: set[str] = set()
        self._done = asyncio.Event()

    async def __aenter__(self) -> EngineSession:
        self._task = asyncio.create_task(self.engine.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.engine.stop()
        await self._task

    def _on_step(self, outputs: list[SeqOutput]) -> None:
        now = time.perf_counter()
        for output in outputs:
            self._times[output.id] += [now] * len(output.token_ids)
            if output.finish_reason:
                self._unfinished.discard(output.id)
        if not self._unfinished:
            self._done.set()

    async def run(self, requests: list[GenRequest]) -> dict[str, list[float]]:
        """Add requests at once; per request: the start time, then the time of every token."""
        start = time.perf_counter()
        self._times = {request.id: [start] for request in requests}
        self._unfinished = set(self._times)
        self._done.clear()
        for request in requests:
            self.engine.add(request)
        await self._done.wait()
        return self._times


async def measure(model: LoadedModel) -> Figures:
    async with EngineSession(model) as session:
        await session.run([GenRequest("warm-up", prompt_ids(model, 64, 99), greedy(8))])

        one = (await session.run([GenRequest("d1", prompt_ids(model, 32, 1), greedy(DECODE_TOKENS))]))["d1"]
        decode_1 = (len(one) - 2) / (one[-1] - one[1])

        batch = [GenRequest(f"b{i}", prompt_ids(model, 32, 100 + i), greedy(DECODE_TOKENS)) for i in range(BATCH)]
        many = await session.run(batch)
        decode_start = max(s[1] for s in many.values())  # every stream has its first token: decode only from here
        decode_end = min(s[-1] for s in many.values())
        decoded = sum(sum(1 for t in s[2:] if decode_start < t <= decode_end) for s in many.values())
        decode_32 = decoded / (decode_end - decode_start)

        prefill = (await session.run([GenRequest("p512", prompt_ids(model, 512, 2), greedy(1))]))["p512"]
        long_prompt = prompt_ids(model, 1024, 3)
        cold = (await session.run([GenRequest("cold", long_prompt, greedy(1))]))["cold"]
        cached_prompt = long_prompt[:1000] + prompt_ids(model, 24, 4)
        cached = (await session.run([GenRequest("cached", cached_prompt, greedy(1))]))["cached"]
    return Figures(
        decode_1=decode_1,
        decode_32=decode_32,
        prefill_512=512 / (prefill[1] - prefill[0]),
        ttft_cold_1024=cold[1] - cold[0],
        ttft_cached_1024=cached[1] - cached[0],
    )


class AttentionClock:
    """Accumulates the time spent in the model's paged attention (plan + per-layer calls)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._originals = (llama.paged_attention, llama.plan_attention)

    def __enter__(self) -> AttentionClock:
        llama.paged_attention = self._timed(self._originals[0])
        llama.plan_attention = self._timed(self._originals[1])
        return self

    def __exit__(self, *exc: object) -> None:
        llama.paged_attention, llama.plan_attention = self._originals

    def _timed(self, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def decode_step_breakdown(model: LoadedModel, batch: int, steps: int = 16, context: int = 128) -> StepBreakdown:
    """Drive the engine's parts by hand through decode steps of `batch` sequences and time each part."""
    engine = Engine(model, on_step=lambda outputs: None)
    for i in range(batch):
        engine.add(GenRequest(f"s{i}", prompt_ids(model, context, 500 + i), greedy(steps + 8)))
    engine._take_incoming()
    while engine.scheduler.waiting or any(seq.num_pending > 1 for seq in engine.scheduler.running):
        _one_step(engine, AttentionClock())  # prefill
    totals = {"schedule": 0.0, "build": 0.0, "model": 0.0, "attention": 0.0, "sampling": 0.0, "bookkeeping": 0.0}
    for _ in range(steps):
        for name, seconds in _one_step(engine, AttentionClock()).items():
            totals[name] += seconds
    ms = {name: 1000 * seconds / steps for name, seconds in totals.items()}
    return StepBreakdown(batch, ms["schedule"], ms["build"], ms["model"], ms["attention"], ms["sampling"], ms["bookkeeping"])


def _one_step(engine: Engine, clock: AttentionClock) -> dict[str, float]:
    t0 = time.perf_counter()
    plan = engine.scheduler.schedule()
    t1 = time.perf_counter()
    batch = build_step_batch(plan.scheduled, engine.scheduler.page_table, engine.kv.page_size, engine.model.device)
    t2 = time.perf_counter()
    with torch.inference_mode(), clock:
        logits = engine.model.model(batch, engine.kv.kv)
    t3 = time.perf_counter()
    samplers = [item for item in plan.scheduled if item.samples]
    states = [engine._active[item.seq.id].sampling for item in samplers]
    with torch.inference_mode():
        rows = [row for row, item in enumerate(plan.scheduled) if item.samples]
        tokens = sample(logits[rows], states)
    t4 = time.perf_counter()
    engine.scheduler.complete(plan)
    for item, token in zip(samplers, tokens):
        engine._append(engine._active[item.seq.id], token)
    t5 = time.perf_counter()
    return {
        "schedule": t1 - t0, "build": t2 - t1, "model": t3 - t2, "attention": clock.seconds,
        "sampling": t4 - t3, "bookkeeping": t5 - t4,
    }  # fmt: skip


def print_table(rows: dict[str, Figures]) -> None:
    names = [f.name for f in fields(Figures)]
    print(f"{'':24}" + "".join(f"{name:>18}" for name in names), flush=True)
    for label, figures in rows.items():
        print(f"{label:24}" + "".join(f"{getattr(figures, name):>18.3f}" for name in names), flush=True)


def print_breakdown(label: str, breakdown: StepBreakdown) -> None:
    parts = {f.name: getattr(breakdown, f.name) for f in fields(StepBreakdown) if f.name != "batch"}
    total = sum(v for k, v in parts.items() if k != "attention_ms")
    body = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
    print(f"{label} decode step, batch {breakdown.batch}: {total:.2f} ms = {body}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--modes", nargs="+", default=["float32/int4"], help="dtype/quant pairs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows: dict[str, Figures] = {}
    for mode in args.modes:
        dtype, quant = mode.split("/")
        model = load_model(args.model, dtype=dtype, quant=quant, device=args.device)
        rows[f"lmq {mode}"] = asyncio.run(measure(model))
        print_table({f"lmq {mode}": rows[f"lmq {mode}"]})
        for batch in (1, BATCH):
            print_breakdown(f"lmq {mode}", decode_step_breakdown(model, batch))
    print_table(rows)


if __name__ == "__main__":
    main()
