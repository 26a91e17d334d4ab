"""Steps on the CPU with torch: cascade attention, one thread for small steps, small batch work beside interactive."""

from __future__ import annotations

from worker.kv_cache import CPU_DEFAULT_BUDGET
from worker.runtime.backend import TorchSteps
from worker.scheduler import BATCH_TOKENS_BESIDE_INTERACTIVE
from worker.step_threads import StepThreads


class CpuTorchBackend(TorchSteps):
    """A CPU step's time grows with its rows, so batch work beside interactive work is kept small
    (worker/scheduler.py), and a small step runs on one thread (worker/step_threads.py)."""

    name = "cpu-torch"
    batch_tokens_beside_interactive = BATCH_TOKENS_BESIDE_INTERACTIVE
    cascade = True  # decodes sharing a prefix attend to it once (aten's CPU flash op returns the log-sum-exp)

    def __init__(self, loaded, max_threads: int) -> None:
        super().__init__(loaded)
        self.step_threads: StepThreads | None = StepThreads(max_threads, loaded.parameter_count)

    def default_kv_bytes(self, needed_bytes: int) -> int:
        return CPU_DEFAULT_BUDGET

    def choose_threads(self, tokens: int) -> None:
        if self.step_threads is not None:
            self.step_threads.choose(tokens)
