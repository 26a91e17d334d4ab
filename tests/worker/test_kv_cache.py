"""The page pool: ref counts, check-then-commit allocation, chained prefix keys, LRU of reusable pages."""

from __future__ import annotations

import pytest
import torch

from worker.kv_cache import KVCache, page_bytes
from worker.pages import OutOfPages, page_key

PAGE = 4


def make_cache(num_pages: int) -> KVCache:
    return KVCache(
        num_pages=num_pages,
        page_size=PAGE,
        num_layers=2,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def chain(token_ids: list[int]) -> list[bytes]:
    keys: list[bytes] = []
    for start in range(0, len(token_ids) - PAGE + 1, PAGE):
        keys.append(page_key(keys[-1] if keys else None, token_ids[start : start + PAGE]))
    return keys


def test_pool_shape_and_page_bytes() -> None:
    cache = make_cache(5)
    assert cache.kv.k.shape == (2, 5, PAGE, 1, 8)
    assert cache.kv.page_size == PAGE and cache.kv.num_pages == 5
    assert page_bytes(2, 1, 8, PAGE, torch.float32) == 2 * 2 * PAGE * 8 * 4


def test_allocate_and_release_return_every_page() -> None:
    cache = make_cache(4)
    pages = cache.allocate(3)
    assert len(set(pages)) == 3 and cache.num_free == 1 and cache.num_used == 3
    assert not cache.can_allocate(2)
    with pytest.raises(OutOfPages):
        cache.allocate(2)
    assert cache.num_free == 1  # a refused allocation takes nothing
    cache.release(pages)
    assert cache.num_free == 4


def test_shared_page_is_freed_by_its_last_user() -> None:
    cache = make_cache(2)
    keys = chain([1, 2, 3, 4])
    [page] = cache.allocate(1)
    cache.register(page, keys[0])
    found = cache.lookup(keys)
    assert found == [page]
    cache.acquire(found)
    cache.release([page])
    assert cache.num_free == 1  # still held by the second user
    cache.release(found)
    assert cache.num_free == 2


def test_page_key_is_chained_on_the_parent() -> None:
    first = page_key(None, [1, 2, 3, 4])
    assert page_key(None, [1, 2, 3, 4]) == first
    assert page_key(first, [5, 6, 7, 8]) != page_key(None, [5, 6, 7, 8])
    assert page_key(None, [1, 2, 3, 4]) != page_key(None, [1, 2, 3, 5])
    assert len(first) == 16


def test_lookup_finds_the_longest_cached_prefix_only() -> None:
    cache = make_cache(8)
    tokens = list(range(12))
    keys = chain(tokens)
    pages = cache.allocate(3)
    for page, key in zip(pages, keys):
        cache.register(page, key)
    cache.release(pages)
    assert cache.lookup(chain(tokens + [99])) == pages
    assert cache.lookup(chain(tokens[:8] + [0, 0, 0, 0])) == pages[:2]
    # The same middle page under another first page never matches.
    assert cache.lookup(chain([7, 7, 7, 7] + tokens[4:])) == []


def test_freed_cached_pages_are_reused_until_memory_is_needed() -> None:
    cache = make_cache(3)
    keys = chain(list(range(8)))
    pages = cache.allocate(2)
    for page, key in zip(pages, keys):
        cache.register(page, key)
    cache.release(pages)
    assert cache.num_free == 3
    # Reviving cached pages counts against the free pages: 2 revived + 2 new > 3.
    assert cache.can_allocate(1, pages)
    assert not cache.can_allocate(2, pages)
    [blank] = cache.allocate(1)
    assert blank not in pages  # a blank page goes before any cached one
    cache.release([blank])
    # Needing all three pages evicts the cached ones, the deepest page first.
    taken = cache.allocate(3)
    assert taken[1] == pages[1] and taken[2] == pages[0]
    assert cache.lookup(keys) == []
    cache.release(taken)
    assert cache.num_free == 3


def test_a_key_already_cached_keeps_its_first_page() -> None:
    cache = make_cache(2)
    [key] = chain([1, 2, 3, 4])
    first, second = cache.allocate(2)
    cache.register(first, key)
    cache.register(second, key)
    cache.release([first, second])
    assert cache.lookup([key]) == [first]
    assert cache.allocate(1) == [second]  # the unkeyed copy went back as a blank page
