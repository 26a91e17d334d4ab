"""Steps on the CPU through the native C++ Llama step (worker/model/native_llama.py, worker/native/).

The native step takes the steps it can (a bfloat16 pool, fewer tokens than its `max_rows`) and torch
the rest, over the same pool, so a sequence moves between the two freely; every other policy is
the CPU's (cpu_torch.py).
"""

from __future__ import annotations

from worker.runtime.cpu_torch import CpuTorchBackend


class CpuNativeBackend(CpuTorchBackend):
    name = "cpu-native"

    def __init__(self, loaded, max_threads: int) -> None:
        super().__init__(loaded, max_threads)
        self.native = loaded.model.native_steps  # attached by the loader (attach_native_steps)
