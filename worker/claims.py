"""The request stream seen by one consumer of the `workers` group: read, claim, keep, count."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol import REQUEST_GROUP


@dataclass(frozen=True)
class Entry:
    """One request stream entry: its id and its raw fields (bytes keys and values)."""

    entry_id: str
    fields: dict[bytes, bytes]


def _entries(raw: list) -> list[Entry]:
    # A deleted entry still pending shows up as (id, None): there is nothing left to run.
    return [Entry(_text(entry_id), fields or {}) for entry_id, fields in raw]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RequestStream:
    def __init__(self, redis: aioredis.Redis, stream: str, consumer: str):
        self.redis = redis
        self.stream = stream
        self.consumer = consumer

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream); whoever starts first does it."""
        try:
            await self.redis.xgroup_create(self.stream, REQUEST_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_new(self, count: int, block_ms: int) -> list[Entry]:
        """Up to `count` entries never delivered to anyone, waiting at most `block_ms`."""
        reply = await self.redis.xreadgroup(REQUEST_GROUP, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        return _entries(reply[0][1]) if reply else []

    async def claim_idle(self, min_idle_ms: int, count: int) -> list[Entry]:
        """Take over up to `count` entries that other consumers left idle for `min_idle_ms`."""
        reply = await self.redis.xautoclaim(self.stream, REQUEST_GROUP, self.consumer, min_idle_ms, start_id="0-0", count=count)
        return _entries(reply[1])

    async def keep(self, entry_ids: list[str]) -> None:
        """Reset the idle time of entries this consumer holds, so that nobody claims them."""
        if entry_ids:
            await self.redis.xclaim(self.stream, REQUEST_GROUP, self.consumer, 0, entry_ids, justid=True)

    async def delivery_count(self, entry_id: str) -> int:
        """How many times the entry was delivered (read or claimed); 0 when it is no longer pending."""
        pending = await self.redis.xpending_range(self.stream, REQUEST_GROUP, min=entry_id, max=entry_id, count=1)
        return pending[0]["times_delivered"] if pending else 0
