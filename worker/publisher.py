"""Everything a worker writes about its requests, sent as one MULTI/EXEC per engine step.

Synchronous code (the engine's step callback, the intake) adds writes; a task sends all
writes gathered since its last send in one transaction: the events (one PUBLISH per pub/sub
reply channel, one XADD per event for reply streams), the token ids streamed so far (so a
re-run after a worker death continues from there), and the acknowledgement of finished
entries. Events and progress can therefore never disagree, whatever moment a worker dies.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError, TimeoutError

from protocol import DEAD_LETTER_STREAM, REQUEST_GROUP, Reply, encode, encode_event_batch, progress_key

log = logging.getLogger(__name__)

REPLY_STREAM_MAXLEN = 10_000
DEAD_LETTER_MAXLEN = 10_000
KEY_TTL_S = 3600
RETRY_DELAY_S = 0.5


@dataclass
class _Writes:
    events: dict[Reply, list[dict[str, Any]]] = field(default_factory=dict)
    progress: dict[str, list[int]] = field(default_factory=dict)
    finished_entries: list[str] = field(default_factory=list)
    finished_requests: list[str] = field(default_factory=list)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.events or self.progress or self.finished_entries or self.dead_letters)


class Publisher:
    def __init__(self, redis: aioredis.Redis, request_stream: str):
        self.redis = redis
        self.request_stream = request_stream
        self._pending = _Writes()
        self._wakeup = asyncio.Event()
        self._sent = asyncio.Event()
        self._sending = False

    # ------------------------------------------------------------ writes (synchronous, never block)

    def send(self, reply: Reply, event: dict[str, Any]) -> None:
        self._pending.events.setdefault(reply, []).append(event)
        self._wakeup.set()

    def record_progress(self, request_id: str, token_ids: list[int]) -> None:
        self._pending.progress.setdefault(request_id, []).extend(token_ids)
        self._wakeup.set()

    def finish(self, entry_id: str, request_id: str | None) -> None:
        """Acknowledge and delete the entry; forget the request's progress."""
        self._pending.finished_entries.append(entry_id)
        if request_id is not None:
            self._pending.finished_requests.append(request_id)
        self._wakeup.set()

    def dead_letter(self, raw: bytes, code: str, message: str, worker_id: str) -> None:
        self._pending.dead_letters.append({"msg": raw, "code": code, "message": message, "worker": worker_id})
        self._wakeup.set()

    # ------------------------------------------------------------ the sending task

    async def run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            writes, self._pending = self._pending, _Writes()
            self._sending = True
            try:
                await self._send(writes)
            finally:
                self._sending = False
            if not self._pending:
                self._sent.set()

    async def flush(self) -> None:
        """Wait until everything added so far is written (the `run` task must be running)."""
        while self._pending or self._sending:
            self._sent.clear()
            await self._sent.wait()

    async def _send(self, writes: _Writes) -> None:
        while True:
            try:
                results = await self._pipeline(writes).execute(raise_on_error=False)
                break
            except (ConnectionError, TimeoutError) as exc:
                log.warning("redis unavailable (%s); retrying a step's writes", exc)
                await asyncio.sleep(RETRY_DELAY_S)
        for result in results:
            if isinstance(result, Exception):  # e.g. a reply key that holds another type
                log.warning("a write failed: %s", result)

    def _pipeline(self, writes: _Writes) -> aioredis.client.Pipeline:
        pipe = self.redis.pipeline(transaction=True)
        for reply, events in writes.events.items():
            if reply.kind == "pubsub":
                pipe.publish(reply.key, encode_event_batch(events))
            else:
                for event in events:
                    pipe.xadd(reply.key, {"msg": encode(event)}, maxlen=REPLY_STREAM_MAXLEN, approximate=True)
                pipe.expire(reply.key, KEY_TTL_S)
        for request_id, token_ids in writes.progress.items():
            if token_ids:
                pipe.rpush(progress_key(request_id), *token_ids)
                pipe.expire(progress_key(request_id), KEY_TTL_S)
        for request_id in writes.finished_requests:
            pipe.delete(progress_key(request_id))
        if writes.finished_entries:
            pipe.xack(self.request_stream, REQUEST_GROUP, *writes.finished_entries)
            pipe.xdel(self.request_stream, *writes.finished_entries)
        for fields in writes.dead_letters:
            pipe.xadd(DEAD_LETTER_STREAM, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        return pipe
