"""The CPU paged attention (page gathers, cascade over shared pages, windows) equals textbook attention.

Each case writes random keys into a pool through the plan's own K/V write, attends with
`paged_attention`, and compares every query's output with softmax(q·K/√d)·V over exactly the keys it
may see, computed in float64 from the keys by position.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.paged_steps import Chunk, make_batch
from worker.model.paged_attention import MIN_SHARED_PAGES, merge_attention, paged_attention, plan_attention

PAGE_SIZE = 4
KV_HEADS, GROUP, HEAD_DIM = 2, 3, 8
HEADS = KV_HEADS * GROUP


def run_step(
    chunks: list[Chunk], history: dict[int, torch.Tensor], num_pages: int, window: int = 0, dtype=torch.float32
):
    """history[i]: keys/values [start, 2, kv_heads, hd] of chunk i's earlier tokens, written into the pool first."""
    generator = torch.Generator().manual_seed(len(chunks) * 7 + window)
    pool_k = torch.zeros(num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)
    pool_v = torch.zeros_like(pool_k)
    for index, chunk in enumerate(chunks):
        for position in range(chunk.start):
            page, offset = chunk.pages[position // PAGE_SIZE], position % PAGE_SIZE
            pool_k[page, offset], pool_v[page, offset] = history[index][position, 0], history[index][position, 1]
    batch = make_batch(chunks, PAGE_SIZE)
    tokens = batch.input_ids.shape[0]
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    plan = plan_attention(batch, PAGE_SIZE, torch.device("cpu"), window)
    out = paged_attention(q, k, v, pool_k, pool_v, batch.slots, plan)
    return batch, plan, q, k, v, out


def reference(chunks, history, q, k, v, window: int = 0) -> torch.Tensor:
    expected = torch.empty(q.shape, dtype=torch.float64)
    token = 0
    for index, chunk in enumerate(chunks):
        count = len(chunk.token_ids)
        keys = (
            torch.cat((history[index][:, 0], k[token : token + count])).double()
            if chunk.start
            else k[token : token + count].double()
        )
        values = (
            torch.cat((history[index][:, 1], v[token : token + count])).double()
            if chunk.start
            else v[token : token + count].double()
        )
        for offset in range(count):
            position = chunk.start + offset
            visible = torch.arange(chunk.start + count) <= position
            if window:
                visible &= torch.arange(chunk.start + count) > position - window
            for head in range(HEADS):
                kv_head = head // GROUP
                scores = keys[:, kv_head] @ q[token + offset, head].double() / HEAD_DIM**0.5
                weights = scores.masked_fill(~visible, float("-inf")).softmax(0)
                expected[token + offset, head] = weights @ values[:, kv_head]
        token += count
    return expected


def history_for(chunks: list[Chunk], shared: int = 0) -> dict[int, torch.Tensor]:
    """Random earlier keys; the first `shared` tokens are the same for every chunk (a shared prompt)."""
    generator = torch.Generator().manual_seed(11)
    common = torch.randn(max(shared, 1), 2, KV_HEADS, HEAD_DIM, generator=generator)
    history = {}
    for index, chunk in enumerate(chunks):
        own = torch.randn(chunk.start, 2, KV_HEADS, HEAD_DIM, generator=generator)
        own[:shared] = common[:shared]
        history[index] = own
    return history


def shared_prompt_decodes(shared_pages: int, lengths: list[int]) -> list[Chunk]:
    """Decodes whose first `shared_pages` pages are the same page ids; each then has pages of its own."""
    next_page = shared_pages + 1
    chunks = []
    for length in lengths:
        own = -(-(length + 1) // PAGE_SIZE) - shared_pages
        pages = list(range(1, shared_pages + 1)) + list(range(next_page, next_page + own))
        next_page += own
        chunks.append(Chunk([5], length, pages))
    return chunks


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_decodes_sharing_pages_attend_to_them_once(dtype: torch.dtype, tolerance: float) -> None:
    shared_pages = MIN_SHARED_PAGES + 2
    lengths = [shared_pages * PAGE_SIZE + extra for extra in (1, 6, 3, 9)]
    chunks = shared_prompt_decodes(shared_pages, lengths)
    history = history_for(chunks, shared=shared_pages * PAGE_SIZE)
    batch, plan, q, k, v, out = run_step(chunks, history, num_pages=64, dtype=dtype)
    assert plan.decode.shared_pages == shared_pages  # the cascade ran
    assert (out.double() - reference(chunks, history, q, k, v)).abs().max() < tolerance


def test_the_cascade_takes_the_pages_every_decode_shares() -> None:
    """Two decodes share six pages, a third only the first four of them: four pages go through the cascade."""
    shared_pages = MIN_SHARED_PAGES + 2
    chunks = shared_prompt_decodes(shared_pages, [shared_pages * PAGE_SIZE + 3, shared_pages * PAGE_SIZE + 5])
    own = list(range(40, 40 + shared_pages - MIN_SHARED_PAGES + 2))
    chunks.append(Chunk([5], shared_pages * PAGE_SIZE + 2, chunks[0].pages[:MIN_SHARED_PAGES] + own))
    history = history_for(chunks, shared=MIN_SHARED_PAGES * PAGE_SIZE)
    history[1][: shared_pages * PAGE_SIZE] = history[0][: shared_pages * PAGE_SIZE]  # pages 5 and 6 hold the same keys
    batch, plan, q, k, v, out = run_step(chunks, history, num_pages=64)
    assert plan.decode.shared_pages == MIN_SHARED_PAGES
    assert (out.double() - reference(chunks, history, q, k, v)).abs().max() < 1e-5


def test_few_shared_pages_take_the_plain_gather() -> None:
    chunks = shared_prompt_decodes(
        MIN_SHARED_PAGES - 1, [MIN_SHARED_PAGES * PAGE_SIZE + 2, MIN_SHARED_PAGES * PAGE_SIZE + 7]
    )
    history = history_for(chunks, shared=(MIN_SHARED_PAGES - 1) * PAGE_SIZE)
    batch, plan, q, k, v, out = run_step(chunks, history, num_pages=64)
    assert plan.decode.shared_pages == 0
    assert (out.double() - reference(chunks, history, q, k, v)).abs().max() < 1e-5


@pytest.mark.parametrize("window", [0, 3, 6, 100])
def test_mixed_step_with_scattered_pages_and_windows(window: int) -> None:
    """Decodes and prefill chunks (one continuing a cache, one fresh) over pages in no particular order."""
    chunks = [
        Chunk([1], 13, [9, 2, 30, 4]),  # a decode at position 13
        Chunk([1, 2, 3, 4, 5], 6, [7, 21, 3]),  # a chunk continuing a 6-token cache, starting mid-page
        Chunk([1], 2, [11]),  # a short decode
        Chunk([1, 2, 3, 4, 5, 6, 7], 0, [12, 13]),  # a fresh prefill
    ]
    history = history_for(chunks)
    batch, plan, q, k, v, out = run_step(chunks, history, num_pages=32, window=window)
    assert (out.double() - reference(chunks, history, q, k, v, window)).abs().max() < 1e-5


def test_merging_two_halves_equals_attention_over_both() -> None:
    generator = torch.Generator().manual_seed(2)
    q, keys, values = (torch.randn(1, 2, 3, 8, generator=generator) for _ in range(3))
    keys, values = torch.randn(1, 2, 10, 8, generator=generator), torch.randn(1, 2, 10, 8, generator=generator)
    whole = torch.nn.functional.scaled_dot_product_attention(q, keys, values)
    first = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys[:, :, :4], values[:, :, :4])
    second = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys[:, :, 4:], values[:, :, 4:])
    assert (merge_attention(first[0], first[1], second[0], second[1]) - whole).abs().max() < 1e-5
