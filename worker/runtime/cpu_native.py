"""Steps on the CPU through the native C++ decoder step (worker/runtime/native_step.py, worker/native/).

The native step takes the steps it can (a bfloat16 pool, fewer tokens than its `max_rows`) and torch
the rest, over the same pool, so a sequence moves between the two freely; every other policy is
the CPU's (cpu_torch.py). `served` counts the steps each path ran, so tests and benchmarks can tell
that the native step was reached rather than silently passed over.
"""

from __future__ import annotations

from collections import Counter

import torch

from worker.batch import PagedKV, StepBatch
from worker.runtime.cpu_torch import CpuTorchBackend
from worker.runtime.native_step import NativeSteps


class CpuNativeBackend(CpuTorchBackend):
    name = "cpu-native"

    def __init__(self, loaded, max_threads: int, native: NativeSteps) -> None:
        super().__init__(loaded, max_threads)
        self.native = native
        self.served: Counter[str] = Counter()  # steps run by "native" and by "torch"

    def forward(self, batch: StepBatch, kv: PagedKV) -> torch.Tensor:
        if self.native.takes(batch, kv):
            self.served["native"] += 1
            return self.native.forward(batch, kv)
        self.served["torch"] += 1
        return super().forward(batch, kv)
