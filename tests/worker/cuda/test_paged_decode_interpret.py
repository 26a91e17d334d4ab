"""The paged decode kernels (worker/cuda/triton_decode.py) in Triton's CPU interpreter, against the torch reference.

Opt-in: skipped where triton is not installed (it is not in the `test` extra: see docs/gpu.md).
The interpreter must be on before triton is first imported, so this module sets TRITON_INTERPRET=1
at import; if something imported triton earlier in the same process, the module is skipped (run it
alone: `.venv/bin/pytest -q tests/worker/cuda/test_paged_decode_interpret.py`).
"""

from __future__ import annotations

import os
import sys

import pytest

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

import torch  # noqa: E402

from worker.cuda.paged_decode import decode_reference, store_kv_reference  # noqa: E402
from worker.cuda.triton_decode import decode, store_kv  # noqa: E402


def make_case(
    *, kv_heads: int, group: int, head_dim: int, page_size: int, contexts: list[int], dtype=torch.float32, seed=0
):
    """A pool of random pages and page tables that share their first pages (a prefix-cache hit) and leave gaps."""
    generator = torch.Generator().manual_seed(seed)
    widest = max(-(-c // page_size) for c in contexts)
    num_pages = 2 + widest * len(contexts)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_pool = torch.randn(shape, generator=generator).to(dtype)
    v_pool = torch.randn(shape, generator=generator).to(dtype)
    order = torch.randperm(num_pages, generator=generator)
    shared = order[:1]  # page 0 of every sequence is the same page
    table = torch.zeros((len(contexts), widest + 1), dtype=torch.int64)  # one stale column past the widest
    for row in range(len(contexts)):
        own = order[1 + row * widest : 1 + (row + 1) * widest]
        table[row, :widest] = torch.cat([shared, own[1:]])
        table[row, widest] = order[-1]
    q = torch.randn((len(contexts), kv_heads * group, head_dim), generator=generator).to(dtype)
    return q, k_pool, v_pool, table, torch.tensor(contexts)


CASES = {
    # name: (kv_heads, group, head_dim, page_size, contexts)
    "gqa3-page16": (3, 3, 64, 16, [1, 17, 150, 16]),  # SmolLM2's grouping; a context of exactly one page
    "gqa4-page4": (2, 4, 32, 4, [9, 1, 200, 0]),  # Llama 3's grouping; a padding row (context 0)
    "mha-page1": (2, 1, 16, 1, [5, 3]),  # one token a page
    "gqa2-page5-odd-dim": (1, 2, 24, 5, [12, 7, 26]),  # a page size and head_dim that are no powers of two
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_kernel_matches_the_reference(name: str, num_splits: int) -> None:
    kv_heads, group, head_dim, page_size, contexts = CASES[name]
    q, k_pool, v_pool, table, context_lens = make_case(
        kv_heads=kv_heads, group=group, head_dim=head_dim, page_size=page_size, contexts=contexts
    )
    got = decode(q, k_pool, v_pool, table, context_lens, num_splits=num_splits)
    want = decode_reference(q, k_pool, v_pool, table, context_lens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    padding = context_lens == 0
    assert (got[padding] == 0).all()


def test_a_soft_cap_bounds_the_scores_first() -> None:
    q, k_pool, v_pool, table, context_lens = make_case(
        kv_heads=2, group=2, head_dim=16, page_size=4, contexts=[13, 30], seed=3
    )
    q = q * 8  # scores far past the cap, where capping changes the weights most
    for num_splits in (1, 2):
        got = decode(q, k_pool, v_pool, table, context_lens, softcap=5.0, num_splits=num_splits)
        want = decode_reference(q, k_pool, v_pool, table, context_lens, softcap=5.0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    uncapped = decode_reference(q, k_pool, v_pool, table, context_lens)
    assert (want - uncapped).abs().max() > 0.1


def test_bfloat16_pool_int32_tables_and_a_window() -> None:
    q, k_pool, v_pool, table, context_lens = make_case(
        kv_heads=2, group=3, head_dim=32, page_size=8, contexts=[30, 3, 19], dtype=torch.bfloat16, seed=1
    )
    for window in (0, 5):
        got = decode(q, k_pool, v_pool, table.int(), context_lens.int(), window=window, num_splits=2, scale=0.3)
        want = decode_reference(q, k_pool, v_pool, table, context_lens, window=window, scale=0.3)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)  # one bfloat16 rounding apart


def test_store_writes_each_token_at_its_slot_and_skips_padding() -> None:
    generator = torch.Generator().manual_seed(2)
    pool_shape = (6, 4, 3, 24)  # pages, page_size, kv_heads, head_dim
    fused = torch.randn((5, 3 * 3 * 24), generator=generator).to(torch.bfloat16)  # q|k|v rows, as the model's qkv
    k = fused[:, 24 * 3 : 24 * 6].view(5, 3, 24)  # strided views, like the model's split
    v = fused[:, 24 * 6 :].view(5, 3, 24)
    slots = torch.tensor([0, 13, -1, 23, 6])
    pools = [torch.full(pool_shape, 9.0, dtype=torch.bfloat16) for _ in range(4)]
    store_kv(k, v, pools[0], pools[1], slots)
    store_kv_reference(k, v, pools[2], pools[3], slots)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    written = pools[0].view(-1, 3, 24)
    assert torch.equal(written[13], k[1]) and (written[1:6] == 9.0).all()  # only the four real slots changed
