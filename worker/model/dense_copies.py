"""Whether packed dense copies of the weights (`--quant auto` on a CPU, worker/model/loader.py) may be kept.

The dense copies cost 2 bytes per weight on top of the quantized ones, so they are kept only when they take
at most DENSE_MEMORY_SHARE of the memory available at start-up; otherwise every step runs on the quantized
weights. Where they pay is measured by bench/engine/linear_crossover.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from worker.model.quant_linear import packed_linear_supported

DENSE_MEMORY_SHARE = 0.25


def dense_copies_fit(dtype: torch.dtype, dense_bytes: int) -> bool:
    """Whether packed dense copies of every linear (`dense_bytes`) can run here and fit the memory share they may take."""
    return (
        packed_linear_supported(torch.device("cpu"), dtype) and dense_bytes <= DENSE_MEMORY_SHARE * available_memory()
    )


def available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 30
