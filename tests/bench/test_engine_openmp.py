"""The engine benchmarks run OpenMP as the worker does: libgomp reads its settings once, when torch loads.

A benchmark that set only OMP_WAIT_POLICY=PASSIVE measured the native step without the worker's short spin
(GOMP_SPINCOUNT, worker/config.py), so every one of the step's barriers woke a sleeping thread: its figures
were not the worker's (at batch 1 on 2 threads the spin is worth 15 ms against 2.7 a step, docs/configuration.md).
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_after_import(module: str) -> dict[str, str | None]:
    """The OpenMP settings a fresh interpreter has after importing `module`, none set beforehand."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS} | {"PYTHONPATH": ROOT}
    code = f"import os, {module}; print(*[os.environ.get(name) for name in {SETTINGS!r}])"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return dict(zip(SETTINGS, (None if v == "None" else v for v in out.stdout.split())))


@pytest.mark.parametrize(
    "module",
    [
        "bench.engine.native_families",
        "bench.engine.speed",
        "bench.engine.native_step_ab",
        "bench.engine.engine_overhead",
        "bench.engine.long_prompt_step",
        "bench.service.priority",
    ],
)
def test_an_engine_benchmark_sets_the_workers_openmp_settings(module):
    worker = openmp_after_import("worker.config")
    assert worker["GOMP_SPINCOUNT"] is not None and worker["OMP_WAIT_POLICY"] == "ACTIVE"
    assert openmp_after_import(module) == worker
