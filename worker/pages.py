"""The page accounting of the paged KV cache: which pages are free, their reference counts, and the
prefix cache. No tensors: the pool itself is worker/kv_cache.py's, so the scheduler, which plans
with pages alone, imports no torch.

A full page is keyed by a strong hash chained on its parent page's key and its own token ids,
so a key matches only when the whole prefix up to that page matches. A page whose last user
releases it keeps its key and waits in an LRU of reusable pages; it is only overwritten when
a new page is needed and no blank page is left.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def page_key(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of a full page: blake2b over the parent's key and the page's token ids."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class OutOfPages(RuntimeError):
    """An allocation was committed without checking `can_allocate` first."""


class PagePool:
    """Page numbers with ref counts and a prefix cache of full pages."""

    def __init__(self, *, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        self.page_size = page_size
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self._blank = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        self._reusable: OrderedDict[int, None] = OrderedDict()  # unreferenced keyed pages, oldest first
        self._key_of_page: dict[int, bytes] = {}
        self._page_of_key: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Pages that an allocation may take now (blank, or unreferenced cached pages)."""
        return len(self._blank) + len(self._reusable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages holding the longest cached run of `keys` (page keys of a sequence, in order)."""
        pages = []
        for key in keys:
            page = self._page_of_key.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def can_allocate(self, new_pages: int, reused: Sequence[int] = ()) -> bool:
        """Whether `new_pages` fresh pages fit after taking references on the cached pages `reused`."""
        revived = sum(1 for page in reused if self._refs[page] == 0)
        return new_pages + revived <= self.num_free

    def acquire(self, pages: Sequence[int]) -> None:
        """Take a reference on cached pages found by `lookup`."""
        for page in pages:
            if self._refs[page] == 0:
                del self._reusable[page]
            self._refs[page] += 1

    def allocate(self, count: int) -> list[int]:
        """Take `count` fresh pages; call `can_allocate` first."""
        if count > self.num_free:
            raise OutOfPages(f"{count} pages asked, {self.num_free} free")
        return [self._take_page() for _ in range(count)]

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page; unreferenced keyed pages become reusable, deepest first."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] > 0:
                continue
            if page in self._key_of_page:
                self._reusable[page] = None
            else:
                self._blank.append(page)

    def register(self, page: int, key: bytes) -> None:
        """Offer a full page to the prefix cache under `key` (kept only if the key is new)."""
        if key in self._page_of_key or page in self._key_of_page:
            return
        self._page_of_key[key] = page
        self._key_of_page[page] = key

    def _take_page(self) -> int:
        if self._blank:
            page = self._blank.pop()
        else:
            page, _ = self._reusable.popitem(last=False)
            del self._page_of_key[self._key_of_page.pop(page)]
        self._refs[page] = 1
        return page
