"""Steps on a CUDA GPU: decode steps replayed from CUDA graphs over the Triton paged-decode kernel
(worker/cuda/), every other step eagerly, never with the CPU-only cascade op.

A GPU decode step costs about the same at 8 rows as at 64, so batch work beside interactive work
is not limited; torch picks its own threads. Batches are built on the host, so a replay sends them
in one pinned copy (worker/cuda/graphs.py).
"""

from __future__ import annotations

import torch

from worker.kv_cache import KVCache
from worker.runtime.backend import TorchSteps

CUDA_FREE_MEMORY_FRACTION = 0.8


class CudaBackend(TorchSteps):
    name = "cuda"
    batch_tokens_beside_interactive = None
    cascade = False

    def __init__(self, loaded, graphs: bool = True) -> None:
        super().__init__(loaded)
        self.graphs = graphs

    @property
    def input_device(self) -> torch.device:
        return getattr(self.model, "input_device", self.device)

    def default_kv_bytes(self, needed_bytes: int) -> int:
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free * CUDA_FREE_MEMORY_FRACTION)

    def prepare(self, kv: KVCache, max_seqs: int) -> None:
        if self.graphs:
            from worker.cuda.graphs import graphed

            self.model = graphed(self.loaded.model, kv.kv, max_batch=max_seqs, num_kv_heads=self.config.num_kv_heads)
