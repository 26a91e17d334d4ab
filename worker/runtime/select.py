"""The one place that chooses where a worker's steps run.

It reads the loaded model's device, and what the loader decided from dtype, quant and `--cpu-steps`
(a native step attached or not). Adding a backend is its own file plus one line here.
"""

from __future__ import annotations

from worker.runtime.backend import StepBackend


def select_backend(loaded, *, max_threads: int) -> StepBackend:
    """The step backend for a loaded model. max_threads: the torch thread's count (the CPU's thread rule)."""
    from worker.runtime.cpu_native import CpuNativeBackend
    from worker.runtime.cpu_torch import CpuTorchBackend
    from worker.runtime.cuda import CudaBackend

    if loaded.device.type == "cuda":
        return CudaBackend(loaded)
    if getattr(loaded.model, "native_steps", None) is not None:
        return CpuNativeBackend(loaded, max_threads)
    return CpuTorchBackend(loaded, max_threads)
