"""Cancellations that arrived before their request started, remembered for a while.

A worker reads a request and starts it a little later (its admission awaits Redis); a cancel that
lands in between names a request the worker does not run yet. It is kept here, keyed as the cancel
names its request (id and token digest, protocol.Cancel), and applied when that request starts.

Every operation is O(1): entries sit in arrival order, so the expired ones are at the front and
leave from there, and at most `limit` are kept (the oldest go first). A flood of cancels for ids
no worker holds costs a constant each and a bounded amount of memory, and cannot slow the loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

MEMORY_S = 120.0
LIMIT = 65_536


class CancelMemory:
    def __init__(self, seconds: float = MEMORY_S, limit: int = LIMIT, clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self.limit = limit
        self._clock = clock
        self._arrived: OrderedDict[Hashable, float] = OrderedDict()

    def remember(self, key: Hashable) -> None:
        now = self._clock()
        self._expire(now)
        self._arrived.pop(key, None)  # a repeated cancel counts from its latest arrival
        self._arrived[key] = now
        if len(self._arrived) > self.limit:
            self._arrived.popitem(last=False)

    def take(self, key: Hashable) -> bool:
        """Whether a live cancellation for `key` was remembered; it is forgotten either way."""
        self._expire(self._clock())
        return self._arrived.pop(key, None) is not None

    def __contains__(self, key: Hashable) -> bool:
        arrived = self._arrived.get(key)
        return arrived is not None and self._clock() - arrived < self.seconds

    def __len__(self) -> int:
        return len(self._arrived)

    def _expire(self, now: float) -> None:
        while self._arrived:
            key, arrived = next(iter(self._arrived.items()))
            if now - arrived < self.seconds:
                return
            del self._arrived[key]
