"""The request streams seen by one consumer of the `workers` group: read, claim, keep, count.

`RequestStream` is one stream. `RequestStreams` is the pair a worker serves, one per priority
(protocol/keys.py: `lmq:req:<model>` and `lmq:req-batch:<model>`), behind the same interface. The
two streams number their entries independently, so the same id can exist in both: a worker names
an entry by a handle that is unique across them (`entry_handle`), the plain id for the interactive
stream (as before priorities existed) and `batch/<id>` for the batch stream, and every write or
acknowledgement goes to the handle's own stream (worker/publisher.py does the same).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol import REQUEST_GROUP
from protocol.keys import INTERACTIVE
from protocol.request_groups import create_request_group
from worker.step_script import KEEP_LUA

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """One request stream entry: its id and its raw fields (bytes keys and values)."""

    entry_id: str
    fields: dict[bytes, bytes]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def is_missing_group(error: ResponseError) -> bool:
    """The stream or its group is gone (FLUSHALL, a Redis restarted without persistence, a deleted key)."""
    return str(error).startswith("NOGROUP")


class RequestStream:
    def __init__(self, redis: aioredis.Redis, stream: str, consumer: str):
        self.redis = redis
        self.stream = stream
        self.consumer = consumer
        self._keep = redis.register_script(KEEP_LUA)

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream); whoever starts first does it."""
        await create_request_group(self.redis, self.stream)

    async def read_new(self, count: int, block_ms: int) -> list[Entry]:
        """Up to `count` entries never delivered to anyone, waiting at most `block_ms`."""
        reply = await self.redis.xreadgroup(REQUEST_GROUP, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        return [Entry(_text(entry_id), fields or {}) for entry_id, fields in reply[0][1]] if reply else []

    async def claim_idle(self, min_idle_ms: int, count: int) -> list[Entry]:
        """Take over up to `count` entries that other consumers left idle for `min_idle_ms`.

        An entry deleted while pending (its client withdrew it) has nothing left to run. Redis 7+
        drops it from the pending list itself; Redis 6.2 claims it and answers `(nil, nil)`, so we
        find it among our pending entries and acknowledge it.
        """
        reply = await self.redis.xautoclaim(self.stream, REQUEST_GROUP, self.consumer, min_idle_ms, start_id="0-0", count=count)
        claimed = [Entry(_text(entry_id), fields or {}) for entry_id, fields in reply[1] if entry_id is not None]
        if len(claimed) < len(reply[1]):
            await self._acknowledge_withdrawn()
        return claimed

    async def _acknowledge_withdrawn(self) -> None:
        pending = await self.redis.xpending_range(self.stream, REQUEST_GROUP, min="-", max="+", count=1000, consumername=self.consumer)
        ids = [_text(item["message_id"]) for item in pending]
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(self.stream, entry_id, entry_id)
        withdrawn = [entry_id for entry_id, found in zip(ids, await pipe.execute()) if not found]
        if withdrawn:
            log.info("acknowledged %d withdrawn entries", len(withdrawn))
            await self.redis.xack(self.stream, REQUEST_GROUP, *withdrawn)

    async def keep(self, entry_ids: list[str]) -> list[str]:
        """Reset the idle time of entries this consumer still owns; the ones another consumer took over."""
        if not entry_ids:
            return []
        lost = await self._keep(keys=[self.stream], args=[REQUEST_GROUP, self.consumer, *entry_ids])
        return [_text(entry_id) for entry_id in lost]

    async def delivery_count(self, entry_id: str) -> int:
        """How many times the entry was delivered (read or claimed); 0 when it is no longer pending."""
        pending = await self.redis.xpending_range(self.stream, REQUEST_GROUP, min=entry_id, max=entry_id, count=1)
        return pending[0]["times_delivered"] if pending else 0


def entry_handle(priority: str, entry_id: str) -> str:
    """A name for an entry that is unique across a worker's streams ('/' never occurs in a stream id)."""
    return entry_id if priority == INTERACTIVE else f"{priority}/{entry_id}"


def split_handle(handle: str) -> tuple[str, str]:
    """(priority, stream entry id) of a handle made by `entry_handle`."""
    priority, slash, entry_id = handle.rpartition("/")
    return (priority, entry_id) if slash else (INTERACTIVE, handle)


class RequestStreams:
    """One consumer's view of its model's streams, one per priority, in the order they are served.

    Entries come out as `Entry` objects whose `entry_id` is a handle (`entry_handle`); every method
    that takes entry ids takes handles and sends each to its own stream."""

    def __init__(self, redis: aioredis.Redis, streams: dict[str, str], consumer: str):
        self.by_priority = {priority: RequestStream(redis, stream, consumer) for priority, stream in streams.items()}

    @property
    def stream(self) -> str:
        """The streams' names, for log lines."""
        return " + ".join(stream.stream for stream in self.by_priority.values())

    async def ensure_group(self) -> None:
        for stream in self.by_priority.values():
            await stream.ensure_group()

    async def read_new(self, priority: str, count: int, block_ms: int) -> list[Entry]:
        """Up to `count` new entries of one priority's stream (each priority has its own reader)."""
        return self._handles(priority, await self.by_priority[priority].read_new(count, block_ms))

    async def claim_idle(self, min_idle_ms: int, counts: dict[str, int]) -> list[Entry]:
        """Take over idle entries, up to `counts[priority]` of each stream, interactive ones first."""
        claimed: list[Entry] = []
        for priority, stream in self.by_priority.items():
            if counts.get(priority, 0) > 0:
                claimed += self._handles(priority, await stream.claim_idle(min_idle_ms, counts[priority]))
        return claimed

    async def keep(self, handles: list[str]) -> list[str]:
        lost: list[str] = []
        for priority, entry_ids in _by_priority(handles).items():
            lost += [entry_handle(priority, entry_id) for entry_id in await self.by_priority[priority].keep(entry_ids)]
        return lost

    async def delivery_count(self, handle: str) -> int:
        priority, entry_id = split_handle(handle)
        return await self.by_priority[priority].delivery_count(entry_id)

    @staticmethod
    def _handles(priority: str, entries: list[Entry]) -> list[Entry]:
        return [Entry(entry_handle(priority, entry.entry_id), entry.fields) for entry in entries]


def _by_priority(handles: list[str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for handle in handles:
        priority, entry_id = split_handle(handle)
        grouped.setdefault(priority, []).append(entry_id)
    return grouped
