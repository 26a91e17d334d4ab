"""Test helpers that drive a model the way the engine does: StepBatch over a PagedKV the test allocates."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.batch import PagedKV, StepBatch
from worker.model.config import ModelConfig


def allocate_kv(
    config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> PagedKV:
    shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
    return PagedKV(k=torch.zeros(shape, dtype=dtype, device=device), v=torch.zeros(shape, dtype=dtype, device=device))


@dataclass
class Chunk:
    """New tokens of one sequence this step; its first token sits at position `start`."""

    token_ids: list[int]
    start: int
    pages: list[int]
    samples: bool = True  # False: a long prompt's chunk short of its end, which gives no logits


def make_batch(chunks: list[Chunk], page_size: int) -> StepBatch:
    input_ids, positions, slots, logits_indices = [], [], [], []
    # A sampling chunk of more than one token ends a prompt (a decode is one token; a one-token prompt's
    # last row is the caller's to declare, with dataclasses.replace).
    prompt_ends = [chunk.samples and len(chunk.token_ids) > 1 for chunk in chunks]
    for chunk in chunks:
        for offset, token in enumerate(chunk.token_ids):
            position = chunk.start + offset
            input_ids.append(token)
            positions.append(position)
            slots.append(chunk.pages[position // page_size] * page_size + position % page_size)
        if chunk.samples:
            logits_indices.append(len(input_ids) - 1)
    max_pages = max(len(chunk.pages) for chunk in chunks)
    page_tables = [chunk.pages + [0] * (max_pages - len(chunk.pages)) for chunk in chunks]
    return StepBatch(
        input_ids=torch.tensor(input_ids),
        positions=torch.tensor(positions),
        slots=torch.tensor(slots),
        query_lens=[len(chunk.token_ids) for chunk in chunks],
        context_lens=[chunk.start + len(chunk.token_ids) for chunk in chunks],
        page_tables=torch.tensor(page_tables),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        prompt_ends=prompt_ends,
    )


def greedy(
    model: torch.nn.Module, kv: PagedKV, prompt_ids: list[int], steps: int, suppress: frozenset[int] = frozenset()
) -> tuple[list[int], list[float]]:
    """Greedy ids and top-2 logit margins of one sequence using pages 0.. of `kv`, prompt in one chunk."""
    page_size = kv.page_size
    pages = list(range((len(prompt_ids) + steps + page_size - 1) // page_size))
    logits = model(make_batch([Chunk(prompt_ids, 0, pages)], page_size), kv)[0]
    ids, margins = [], []
    for step in range(steps):
        if suppress:
            logits[list(suppress)] = float("-inf")
        top = logits.topk(2)
        ids.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        if step + 1 < steps:
            logits = model(make_batch([Chunk([ids[-1]], len(prompt_ids) + step, pages)], page_size), kv)[0]
    return ids, margins
