"""The paged KV cache: the K and V tensors of a fixed pool of pages, over the page accounting of
worker/pages.py (free pages, reference counts, the prefix cache).
"""

from __future__ import annotations

import torch

from worker.batch import PagedKV
from worker.pages import PagePool

GIB = 1 << 30
CPU_DEFAULT_BUDGET = 1 * GIB  # `--kv-memory auto` on a CPU (worker/runtime/cpu_torch.py)


def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page: K and V of `page_size` tokens across all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * page_size * num_kv_heads * head_dim * element


class KVCache(PagePool):
    """The page pool's tensors (`kv`: K and V, layer × page × slot × head × dim) and its accounting."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(num_pages=num_pages, page_size=page_size)
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.kv = PagedKV(
            k=torch.zeros(shape, dtype=dtype, device=device), v=torch.zeros(shape, dtype=dtype, device=device)
        )
