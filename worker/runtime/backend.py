"""The step backend: everything about an engine step that differs by where the step runs.

The engine (worker/engine.py) schedules, samples and detokenizes the same way everywhere; what it
asks of the backend is the KV budget and pool, the step's batch (built where the forward wants it,
and whether its attention may use the CPU's cascade op), the thread and batch-token policies, and
the forward, which returns logits for the sampling rows only. `select.py` is the one place that
reads the device, dtype, quant and `--cpu-steps` to choose an implementation:

    cpu_torch.py   torch on the CPU (cascade attention, thread-per-step rule, small batch work beside interactive)
    cpu_native.py  the native C++ decoder step (native_step.py, worker/native/), torch for the steps it does not take
    cuda.py        CUDA graphs for decode steps, the Triton paged-decode kernel, eager for the rest

`TorchSteps` holds what the three share; an implementation overrides only what differs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from worker.batch import PagedKV, StepBatch
from worker.kv_cache import KVCache, page_bytes
from worker.scheduler import Scheduled

log = logging.getLogger(__name__)

Forward = Callable[[StepBatch, PagedKV], torch.Tensor]


class StepBackend(Protocol):
    """What the engine needs from where its steps run. All methods run on the torch thread."""

    name: str
    device: torch.device
    # Batch tokens a step may carry beside interactive work (worker/scheduler.py); None: the whole step.
    batch_tokens_beside_interactive: int | None

    def make_kv(self, kv_memory_bytes: int | None, page_size: int, max_seqs: int) -> KVCache:
        """The KV pool: `kv_memory_bytes`, or the backend's default budget when None."""

    def prepare(self, kv: KVCache, max_seqs: int) -> None:
        """Once, after the pool exists: whatever the steps need set up over it (CUDA: capture the graphs)."""

    def build_batch(self, scheduled: list[Scheduled], page_size: int) -> StepBatch:
        """The step's input, on the device the forward reads it from; logits_indices name sampling rows only."""

    def forward(self, batch: StepBatch, kv: PagedKV) -> torch.Tensor:
        """float32 logits [sampling rows, vocab], after setting the step's threads where the backend has a rule."""


class TorchSteps:
    """The shared part: a torch model's forward over a batch built on `input_device`."""

    name = "torch"
    batch_tokens_beside_interactive: int | None = None
    cascade = False  # whether attention may use the CPU-only cascade op (worker/model/paged_attention.py)

    def __init__(self, loaded) -> None:
        self.loaded = loaded
        self.device: torch.device = loaded.device
        self.config = loaded.config
        self.model: Forward = loaded.model

    @property
    def input_device(self) -> torch.device:
        return self.device

    def default_kv_bytes(self, needed_bytes: int) -> int:
        """The default budget, never more than `needed_bytes` (every sequence at full context)."""
        raise NotImplementedError

    def kv_page_bytes(self, page_size: int) -> int:
        config = self.config
        return page_bytes(config.num_layers, config.num_kv_heads, config.head_dim, page_size, self.loaded.dtype)

    def make_kv(self, kv_memory_bytes: int | None, page_size: int, max_seqs: int) -> KVCache:
        config = self.config
        per_page = self.kv_page_bytes(page_size)
        if kv_memory_bytes is None:
            pages_per_seq = -(-config.max_context // page_size)
            kv_memory_bytes = min(
                self.default_kv_bytes(max_seqs * pages_per_seq * per_page), max_seqs * pages_per_seq * per_page
            )
        num_pages = kv_memory_bytes // per_page
        if num_pages < 1:
            raise ValueError(f"a KV budget of {kv_memory_bytes} bytes holds no page of {per_page} bytes")
        log.info("KV cache: %d pages of %d tokens (%.1f MiB)", num_pages, page_size, num_pages * per_page / 2**20)
        return KVCache(
            num_pages=num_pages,
            page_size=page_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=self.loaded.dtype,
            device=self.device,
        )

    def prepare(self, kv: KVCache, max_seqs: int) -> None:
        pass

    def build_batch(self, scheduled: list[Scheduled], page_size: int) -> StepBatch:
        return build_step_batch(scheduled, page_size, self.input_device, cascade=self.cascade)

    def choose_threads(self, tokens: int) -> None:
        pass

    def forward(self, batch: StepBatch, kv: PagedKV) -> torch.Tensor:
        self.choose_threads(batch.input_ids.numel())
        return self.model(batch, kv)


def build_step_batch(
    scheduled: list[Scheduled], page_size: int, device: torch.device, *, cascade: bool = True
) -> StepBatch:
    """The model's input for one step: each sequence's next tokens, where their K/V go, and logits only
    for the sequences that sample (a prompt chunk short of its prompt's end gets none)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    logits_indices: list[int] = []
    prompt_ends: list[bool] = []
    for item in scheduled:
        seq, start = item.seq, item.seq.num_computed
        end = start + item.num_tokens
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += [seq.pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
        query_lens.append(item.num_tokens)
        prompt_ends.append(item.samples and end <= seq.num_prompt_tokens)
        context_lens.append(end)
        if item.samples:
            logits_indices.append(len(input_ids) - 1)
    max_pages = -(-max(context_lens) // page_size)
    tables = [item.seq.pages[:max_pages] for item in scheduled]
    page_tables = torch.tensor([pages + [0] * (max_pages - len(pages)) for pages in tables], dtype=torch.int64)
    return StepBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device),
        positions=torch.tensor(positions, dtype=torch.int64).to(device),
        slots=torch.tensor(slots, dtype=torch.int64).to(device),
        query_lens=query_lens,
        context_lens=context_lens,
        page_tables=page_tables.to(device),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64).to(device),
        cascade=cascade,
        prompt_ends=prompt_ends,
    )
