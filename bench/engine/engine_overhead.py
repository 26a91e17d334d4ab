"""Where an engine decode step's time goes around the native step: one family's real shape, N streams.

    .venv/bin/python -m bench.engine.engine_overhead                     # Qwen3-0.6B's shape, 16 streams
    .venv/bin/python -m bench.engine.engine_overhead --streams 16 --tokens 32 --rounds 2
    .venv/bin/python -m bench.engine.engine_overhead --model .bench/shapes/qwen3-30b-a3b-4l-random.Q4_0.gguf --streams 1

The real Engine on the cpu-native backend (bench/engine/native_families.py's random-weight model, loaded
in the default CPU mode), greedy streams decoding together; every part of each decode step is timed by
wrapping it, so the step's wall time (from one step's outputs to the next's) splits into:

- the event loop's share: scheduling, then after the step the scheduler's bookkeeping, detokenizing,
  stop checks and the outputs' callback (`_append`, `on_step`);
- the hop to the compute thread and back (run_in_executor's wake-ups), what is left of `run_async`
  around the compute function;
- in the compute thread: building the batch, the forward's Python around the native call, the native
  call itself (the sum of its phase clock, native_step.PHASES), sampling, the sampler's `record`.

The OpenMP settings are the process's own (libgomp reads them when torch loads): the worker's are
OMP_WAIT_POLICY=ACTIVE and GOMP_SPINCOUNT=3000 (worker/config.py), which this module sets unless the
environment already has them, so run it with `env OMP_WAIT_POLICY=PASSIVE` to see steps whose barriers
sleep at once (the throttled spin, worker/config.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as the worker waits (worker/config.py); before torch loads
os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # a short spin, then sleep

import argparse
import asyncio
import pathlib
import statistics
import tempfile
import time
from collections import defaultdict

import torch

import worker.engine as engine_module
from bench.engine.native_families import SHAPES, model_label, model_path, run_greedy
from bench.engine.quality import cpu_model
from worker import compute_thread
from worker.engine import Engine, SeqOutput
from worker.model.loader import load_model
from worker.runtime.native_step import PHASES
from worker.runtime.select import select_backend

SAMPLE, RUN_ASYNC = engine_module.sample, compute_thread.run_async
PARTS = ("schedule", "hop", "build_batch", "forward (Python)", "native step", "sample", "record", "after the step")


class Spans:
    """Seconds per part of the current step; a step's record closes when its outputs reach `on_step`."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.last_output: float | None = None

    def timed(self, part: str, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - start

        return wrapper

    def timed_async(self, part: str, function):
        async def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await function(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - start

        return wrapper

    def outputs(self, now: float, decode_rows: int) -> None:
        step = dict(self.current)
        if self.last_output is not None and decode_rows:
            step["wall"] = now - self.last_output
            step["rows"] = decode_rows
            self.steps.append(step)
        self.current.clear()
        self.last_output = now


def install(engine: Engine, spans: Spans) -> torch.Tensor:
    """Wrap the engine's parts in spans; returns the native step's phase clock (float64 seconds)."""
    backend, native = engine.backend, engine.backend.native
    engine.scheduler.schedule = spans.timed("schedule", engine.scheduler.schedule)
    backend.build_batch = spans.timed("build_batch", backend.build_batch)
    backend.forward = spans.timed("forward", backend.forward)
    engine_module.sample = spans.timed("sample", engine_module.sample)
    compute = spans.timed("compute", engine._compute)
    engine._compute = compute
    compute_thread.run_async = spans.timed_async("run_async", RUN_ASYNC)
    phases = torch.zeros(len(PHASES), dtype=torch.float64)
    native.phase_seconds = phases
    return phases


def split(step: dict[str, float], native_s: float) -> dict[str, float]:
    """The step's parts that do not overlap: each wrapper's time less the wrappers inside it."""
    forward, compute, run_async = step.get("forward", 0.0), step.get("compute", 0.0), step.get("run_async", 0.0)
    inside = step.get("build_batch", 0.0) + forward + step.get("sample", 0.0)
    return {
        "schedule": step.get("schedule", 0.0),
        "hop": run_async - compute,
        "build_batch": step.get("build_batch", 0.0),
        "forward (Python)": forward - native_s,
        "native step": native_s,
        "sample": step.get("sample", 0.0),
        "record": compute - inside,
        "after the step": step["wall"] - step.get("schedule", 0.0) - run_async,
    }


async def measure(loaded, backend, streams: int, tokens: int, salt: int) -> list[dict[str, float]]:
    """Per decode step of `streams` greedy streams: its wall time and its parts (PARTS), in seconds."""
    spans = Spans()
    finished: set[str] = set()
    done = asyncio.Event()
    engine: Engine | None = None
    phases_seen = [0.0]

    def on_step(outputs: list[SeqOutput]) -> None:
        now = time.perf_counter()
        running = sum(1 for output in outputs if output.finish_reason is None)
        step_phases = phases.sum().item() - phases_seen[0]
        phases_seen[0] += step_phases
        spans.current["native"] = step_phases
        decode = len(outputs) == streams and running == streams and engine.stats.waiting == 0
        spans.outputs(now, streams if decode else 0)
        finished.update(output.id for output in outputs if output.finish_reason)
        if len(finished) == streams:
            done.set()

    engine = Engine(loaded, on_step=on_step, backend=backend)
    phases = install(engine, spans)
    await run_greedy(engine, streams, tokens, salt, done)
    engine_module.sample, compute_thread.run_async = SAMPLE, RUN_ASYNC
    del backend.build_batch, backend.forward  # the backend's own methods again, for the next round
    backend.native.phase_seconds = None
    return [split(step, step.get("native", 0.0)) | {"wall": step["wall"]} for step in spans.steps[2:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--model", help="a GGUF file instead of the shape (bench/service/shapes.py writes them)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32, help="generated per stream")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        loaded = load_model(model_path(args.model, args.shape, pathlib.Path(directory)), device="cpu")
        threads = torch.get_num_threads()  # before the first engine sets this thread's to 1 (compute_thread.py)
        backend = select_backend(loaded, max_threads=threads)
        assert backend.name == "cpu-native", "the native step does not serve this shape"
        steps: list[dict[str, float]] = []
        for round_ in range(args.rounds):
            steps += asyncio.run(measure(loaded, backend, args.streams, args.tokens, salt=round_))
    cpu = cpu_model()
    print(f"\n{model_label(args.model, args.shape)}, {args.streams} greedy streams, {threads} threads, {cpu}")
    print(f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}")
    print(f"{len(steps)} decode steps, ms (median, mean); load {os.getloadavg()}")
    for part in ("wall", *PARTS):
        values = [step[part] * 1e3 for step in steps]
        print(f"  {part:18s} {statistics.median(values):8.2f} {statistics.fmean(values):8.2f}")


if __name__ == "__main__":
    main()
