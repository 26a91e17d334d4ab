"""The one place that chooses where a worker's steps run.

It resolves `--device`, `--dtype` and `--quant` for the loader (`resolve_device`, `resolve_weight_mode`),
and picks the step backend from the loaded model's device, dtype, quant and `--cpu-steps`: CUDA on a GPU;
on a CPU the native step (worker/runtime/native_step.py) wherever it can serve the model, which that module
says (`unsupported` gives the reason when not), else torch. Adding a backend is its own file plus one
line in `select_backend`.
"""

from __future__ import annotations

import logging

import torch

from worker.model.embedding import build_tables
from worker.model.lazy_linear import build_linears, release_linears, unbuilt_linears
from worker.model.quant_linear import drop_dense_copies
from worker.runtime.backend import StepBackend
from worker.runtime.freed_memory import return_freed_memory

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTS = ("none", "int8", "int4")
# CPU defaults, measured on SmolLM2-135M: int4 weights with bfloat16 activations are fastest at small batches
# (the int4/int8 kernels are ~20x slower with float32 activations). With bfloat16, `--quant auto` adds an int8
# head for small steps and packed dense copies for long prompts (worker/model/loader.py).
CPU_DEFAULT_DTYPE = "bfloat16"
CPU_DEFAULT_QUANT = "int4"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_weight_mode(dtype: str, quant: str, device: torch.device) -> tuple[torch.dtype, str]:
    """'auto' picks bfloat16 + int4 on CPU and bfloat16 without quantization on CUDA."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, not {dtype!r}")
    if quant != "auto" and quant not in QUANTS:
        raise ValueError(f"quant must be auto or one of {QUANTS}, not {quant!r}")
    on_cpu = device.type == "cpu"
    if quant == "auto":
        quant = CPU_DEFAULT_QUANT if on_cpu else "none"
    if dtype == "auto":
        dtype = CPU_DEFAULT_DTYPE if on_cpu else "bfloat16"
    if quant != "none" and not on_cpu:
        log.warning("quant %s has no kernel on %s: using unquantized %s weights", quant, device, dtype)
        quant = "none"
    return DTYPES[dtype], quant


def tiered_cpu_weights(dtype: str, quant: str, device: torch.device) -> bool:
    """Whether the loader tiers the weights by step size (int8 head, packed dense copies for long steps):
    `quant auto` on a CPU in bfloat16."""
    return quant == "auto" and device.type == "cpu" and dtype in ("auto", "bfloat16")


def select_backend(loaded, *, max_threads: int) -> StepBackend:
    """The step backend for a loaded model. max_threads: the torch thread's count (the CPU's thread rule),
    and the native step's team."""
    backend = _backend(loaded, max_threads)
    if loaded.checkpoint is not None:
        loaded.checkpoint.release_file_pages()  # every step reads copies: the packed, built or moved weights
    return backend


def _backend(loaded, max_threads: int) -> StepBackend:
    from worker.runtime.cpu_native import CpuNativeBackend
    from worker.runtime.cpu_torch import CpuTorchBackend
    from worker.runtime.cuda import CudaBackend

    if loaded.device.type == "cuda":
        return CudaBackend(loaded)
    invariant = loaded.cpu_steps == "invariant"
    reason = native_refusal(loaded)
    if reason is None:
        from worker.runtime.native_step import NativeSteps

        native = NativeSteps.build(loaded.model, loaded.checkpoint, max_threads, loaded.dense_from_rows, invariant)
        if native.max_rows is None:
            _torch_linears_unused(loaded)
        else:
            _build_torch_linears(loaded)  # long prompts run on torch
        return CpuNativeBackend(loaded, max_threads, native)
    if invariant:
        log.warning("cpu_steps invariant: %s; torch's steps depend on the batch", reason)
    elif loaded.cpu_steps != "torch":
        log.info("native steps off: %s; steps run on torch", reason)
    _build_torch_linears(loaded)
    return CpuTorchBackend(loaded, max_threads)


def _torch_linears_unused(loaded) -> None:
    """The native step serves every step: the linears the loader left unbuilt stay so (worker/model/lazy_linear.py),
    and those built anyway (the head's int8 tier the native step packed its copy from, a linear a torch forward
    built before) and dense copies are let go."""
    dropped = drop_dense_copies(loaded.model) + release_linears(loaded.model)
    return_freed_memory()
    unbuilt = len(unbuilt_linears(loaded.model))
    log.info(
        "the native step serves every step: %d torch linears left unbuilt, %d built ones and dense copies let go",
        unbuilt, dropped,
    )  # fmt: skip
    loaded.dense_from_rows = None


def _build_torch_linears(loaded) -> None:
    """The torch path runs steps: its linears and embedding table are built now, not in its first step."""
    built = build_linears(loaded.model) + build_tables(loaded.model)
    if built:
        log.info("built the torch path's %d linears and tables", built)


def native_refusal(loaded) -> str | None:
    """Why the native step does not serve this CPU model's steps; None when it does."""
    from worker.runtime.native_step import unsupported

    mode = native_mode_refusal(loaded.cpu_steps, loaded.device, loaded.dtype, loaded.quant)
    if mode is not None:
        return mode
    if loaded.checkpoint is None:
        return "the model was built in memory, with no checkpoint to pack its int4 blocks from"
    return unsupported(loaded.model, loaded.checkpoint)


def native_mode_refusal(cpu_steps: str, device: torch.device, dtype: torch.dtype, quant: str) -> str | None:
    """Why the native step does not serve a model loaded in this mode; None when it may (the model may still
    have no native form: native_refusal)."""
    if cpu_steps == "torch":
        return "--cpu-steps torch"
    if device.type != "cpu":
        return f"it runs on the CPU, not {device}"
    if dtype != torch.bfloat16 or quant != "int4":
        return f"it runs bfloat16/int4 weights, not {str(dtype).removeprefix('torch.')}/{quant}"
    return None
