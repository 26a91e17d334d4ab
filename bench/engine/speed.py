"""Engine benchmark on the default model, next to HF transformers' generate: decode, prefill, prefix-cache TTFT, step breakdown.

    .venv/bin/python -m bench.engine.speed            # every weight mode that matters, 2 threads, writes the doc section
    .venv/bin/python -m bench.engine.speed --quick    # a smoke run: tiny token counts, nothing written to the doc

Per lmq weight mode (dtype/quant), through the real `Engine.run` fed `GenRequest`s: decode tok/s of one
stream and aggregate over 32 streams, prefill tok/s of a 512-token prompt, time to first token of a
1,024-token prompt cold and with its first 1,000 tokens cached, and where one decode step's time goes
(model, attention, sampling, Python/engine overhead) at batch 1 and 32. The same decode and prefill
figures for HF transformers' `generate` on the same GGUF, and lmq ÷ HF against the issue's targets.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as the worker waits (worker/config.py); before torch loads
os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # a short spin, then sleep

import argparse
import asyncio
import dataclasses
import datetime
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import worker.engine as engine_module
import worker.model.llama as llama
import worker.runtime.backend as backend_module
from bench.engine import peer_hf
from bench.engine import speed_report as engine_report
from bench.engine.speed_report import Breakdown, Figures, Sizes
from protocol import SamplingParams
from worker import compute_thread
from worker.engine import Engine, GenRequest, SeqOutput
from worker.model.loader import LoadedModel, default_model_path, load_model

ROOT = Path(__file__).resolve().parents[2]
MODES = [
    "auto/auto",
    "bfloat16/int4",
    "bfloat16/none",
    "bfloat16/int8",
    "float32/none",
]  # auto: the default (worker/model/loader.py: int4, int8 head, dense copies for long prompts)


def prompt_ids(model: LoadedModel, length: int, salt: int) -> list[int]:
    """`length` token ids of plain text, different per salt from the first token on."""
    text = f"Note {salt}: " + " ".join(f"the item {salt}-{i} is on the shelf." for i in range(length))
    return model.tokenizer.encode(text, add_special_tokens=False).ids[:length]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@dataclasses.dataclass
class StepRecord:
    decode_only: bool
    sequences: int
    build_s: float
    model_s: float = 0.0
    attention_s: float = 0.0
    sampling_s: float = 0.0
    wall_s: float | None = None  # from the previous step's outputs to this step's


class StepProbe:
    """Times the parts of each step of a running engine; the loop's wall time per step comes from its outputs.

    The parts run in the engine's model thread and each step's outputs arrive after them, so no lock is needed.
    """

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self._last_output: float | None = None
        self._steps_at_last_output = 0

    def install(self, engine: Engine) -> Callable[[], None]:
        """Wrap the engine's batch building, model, sampling and the model's attention; returns the undo."""
        originals = (backend_module.build_step_batch, engine_module.sample, llama.plan_attention, llama.paged_attention)
        backend_module.build_step_batch = self._build(originals[0])
        engine_module.sample = self._timed(originals[1], "sampling_s")
        llama.plan_attention = self._timed(originals[2], "attention_s")
        llama.paged_attention = self._timed(originals[3], "attention_s")
        forward = engine.backend.model
        engine.backend.model = self._timed(forward, "model_s")
        native = getattr(engine.backend, "native", None)  # the cpu-native backend calls its native step directly
        if native is not None:
            native.forward = self._timed(type(native).forward.__get__(native), "model_s")

        def undo() -> None:
            backend_module.build_step_batch, engine_module.sample, llama.plan_attention, llama.paged_attention = (
                originals
            )
            engine.backend.model = forward
            if native is not None:
                del native.forward

        return undo

    def _build(self, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            batch = function(*args, **kwargs)
            self.steps.append(StepRecord(batch.is_decode_only, len(batch.query_lens), time.perf_counter() - start))
            return batch

        return timed

    def _timed(self, function, part: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                record = self.steps[-1]
                setattr(record, part, getattr(record, part) + time.perf_counter() - start)

        return timed

    def start_run(self) -> None:
        self._last_output = None

    def outputs_at(self, now: float) -> None:
        """A step's outputs arrived: its wall time is known when it is the only step since the previous outputs."""
        if self._last_output is not None and len(self.steps) == self._steps_at_last_output + 1:
            self.steps[-1].wall_s = now - self._last_output
        self._last_output, self._steps_at_last_output = now, len(self.steps)

    def decode_steps(self, sequences: int, since: int) -> list[StepRecord]:
        return [s for s in self.steps[since:] if s.decode_only and s.sequences == sequences and s.wall_s is not None]


def breakdown(steps: list[StepRecord], batch: int) -> Breakdown:
    def mean_ms(part: str) -> float:
        return 1000 * sum(getattr(s, part) for s in steps) / len(steps)

    return Breakdown(
        batch=batch, steps=len(steps), step_ms=mean_ms("wall_s"), model_ms=mean_ms("model_s"),
        attention_ms=mean_ms("attention_s"), sampling_ms=mean_ms("sampling_s"), build_ms=mean_ms("build_s"),
    )  # fmt: skip


class EngineSession:
    """One running engine (and its prefix cache) shared by several timed runs."""

    def __init__(self, model: LoadedModel) -> None:
        self.engine = Engine(model, on_step=self._on_step)
        self.probe = StepProbe()
        self._times: dict[str, list[float]] = {}
        self._unfinished: set[str] = set()
        self._done = asyncio.Event()

    async def __aenter__(self) -> EngineSession:
        self._undo = self.probe.install(self.engine)
        self._task = asyncio.create_task(self.engine.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.engine.stop()
        await self._task
        self._undo()

    def _on_step(self, outputs: list[SeqOutput]) -> None:
        now = time.perf_counter()
        self.probe.outputs_at(now)
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
        self.probe.start_run()
        for request in requests:
            self.engine.add(request)
        await self._done.wait()
        return self._times

    async def decode(self, prompts: list[list[int]], tokens: int) -> Breakdown:
        """Generate `tokens` for every prompt at once; the decode steps where all of them run."""
        since = len(self.probe.steps)
        await self.run([GenRequest(f"d{len(prompts)}-{i}", ids, greedy(tokens)) for i, ids in enumerate(prompts)])
        return breakdown(self.probe.decode_steps(len(prompts), since), len(prompts))

    async def ttft(self, prompt: list[int]) -> float:
        times = (await self.run([GenRequest("ttft", prompt, greedy(1))]))["ttft"]
        return times[1] - times[0]


@dataclasses.dataclass
class Workload:
    """The prompts, shared by lmq and HF: every one distinct from the first token on (no accidental cache hits)."""

    warm_up: list[int]
    decode: list[list[int]]  # [0] is the single stream; all of them the batch
    prefills: list[list[int]]  # the prefill figure is the median over these
    long_prompt: list[int]
    cached_prompt: list[int]  # long_prompt's first `sizes.cached` tokens, then new ones

    @classmethod
    def build(cls, model: LoadedModel, sizes: Sizes) -> Workload:
        long_prompt = prompt_ids(model, sizes.long_prompt, 3)
        return cls(
            warm_up=prompt_ids(model, sizes.prefill, 99),
            decode=[prompt_ids(model, sizes.decode_prompt, 100 + i) for i in range(sizes.batch)],
            prefills=[prompt_ids(model, sizes.prefill, salt) for salt in (2, 5, 6)],
            long_prompt=long_prompt,
            cached_prompt=long_prompt[: sizes.cached] + prompt_ids(model, sizes.long_prompt - sizes.cached, 4),
        )


async def measure(model: LoadedModel, work: Workload, sizes: Sizes) -> tuple[Figures, list[Breakdown]]:
    async with EngineSession(model) as session:
        await session.run([GenRequest("warm-up", work.warm_up, greedy(4))])
        single = await session.decode(work.decode[:1], sizes.decode_tokens)
        batch = await session.decode(work.decode, sizes.decode_tokens)
        prefill = statistics.median([await session.ttft(prompt) for prompt in work.prefills])
        cold = await session.ttft(work.long_prompt)
        cached = await session.ttft(work.cached_prompt)
    figures = Figures(
        decode_1=1000 / single.step_ms,
        decode_batch=1000 * sizes.batch / batch.step_ms,
        prefill=sizes.prefill / prefill,
        ttft_cold_s=cold,
        ttft_cached_s=cached,
    )
    return figures, [single, batch]


def machine() -> str:
    from bench.service.run_all import machine as describe

    return describe()


def shown_command(argv: list[str]) -> str:
    python = ".venv/bin/python" if sys.executable.startswith(str(ROOT)) else "python"
    parts = [os.path.relpath(part, ROOT) if part.startswith(str(ROOT)) else part for part in argv]
    return shlex.join([python, "-m", "bench.engine.speed", *parts])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--modes", nargs="+", default=MODES, help="lmq dtype/quant pairs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny token counts; the doc is not rewritten")
    parser.add_argument("--skip-peer", action="store_true", help="no HF transformers run (no ratios)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/engine.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs/benchmarks.md")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)  # the torch thread (worker/compute_thread.py) takes this count
    sizes = engine_report.QUICK if args.quick else engine_report.FULL
    load_before = os.getloadavg()[0]
    path = args.model or default_model_path()
    rows: dict[str, Figures] = {}
    breakdowns: dict[str, list[Breakdown]] = {}
    work = Workload.build(compute_thread.run(load_model, str(path), dtype="float32", quant="none", device="cpu"), sizes)
    peer_label = None
    if not args.skip_peer:
        peer_label = f"HF transformers {peer_hf.version()} generate, float32"
        started = time.perf_counter()
        rows[peer_label] = compute_thread.run(peer_hf.measure, path, sizes, work.decode, work.prefills)
        print(
            engine_report.figures_table({peer_label: rows[peer_label]}, sizes),
            f"\n({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    for mode in args.modes:
        dtype, quant = mode.split("/")
        started = time.perf_counter()
        model = compute_thread.run(load_model, str(path), dtype=dtype, quant=quant, device="cpu")
        label = f"lmq {mode}"
        rows[label], breakdowns[label] = asyncio.run(measure(model, work, sizes))
        print(engine_report.figures_table({label: rows[label]}, sizes), flush=True)
        print(
            engine_report.breakdown_table({label: breakdowns[label]}),
            f"\n({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    print("\n" + engine_report.figures_table(rows, sizes))
    if peer_label:
        print("\n" + engine_report.ratio_table(rows, rows[peer_label], peer_label, sizes))
    print("\n" + engine_report.breakdown_table(breakdowns), flush=True)

    date = datetime.date.today().isoformat()
    result = {
        "date": date, "machine": machine(), "command": shown_command(argv), "threads": args.threads,
        "load_before": load_before, "sizes": dataclasses.asdict(sizes), "peer": peer_label,
        "figures": {label: dataclasses.asdict(f) for label, f in rows.items()},
        "breakdowns": {label: [dataclasses.asdict(b) | {"overhead_ms": b.overhead_ms} for b in bs] for label, bs in breakdowns.items()},
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    if not args.quick and peer_label and breakdowns:
        section = engine_report.render(
            rows=rows, peer_label=peer_label, breakdowns=breakdowns, sizes=sizes, machine=result["machine"], date=date,
            command=result["command"], load_before=load_before, threads=args.threads,
        )  # fmt: skip
        engine_report.write_section(args.doc, section)
        print(f"\nwrote {args.json} and {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
