"""Everything a worker writes about its requests, sent as one fenced script per engine step.

Synchronous code (the engine's step callback, the intake) adds writes, each tied to the stream
entry of its request; a task sends all writes gathered since its last send in one call of the
step script (worker/step_script.py): the events (one PUBLISH per pub/sub reply channel, one XADD
per event for reply streams), the token ids streamed so far (so a re-run after a worker death
continues from there), and the acknowledgement of finished entries. Events and progress can
therefore never disagree, whatever moment a worker dies, and a worker that lost an entry to
another one writes nothing more for it.

On a Redis Cluster a script may only touch keys of one hash slot, and each shard's keys share one
(protocol/keys.py): a step's writes go as one script call per shard they touch, concurrently. The
progress and holder keys of a request are those of the shard its entry came from.

No request's output can break another's: a channel's events of one step go out in as many
PUBLISHes as keep each message within protocol.MAX_MESSAGE_BYTES (which a gateway refuses whole,
and with it the other requests' events), and a single event that cannot fit even alone (a tokenize
answer of a huge prompt) is replaced by a `too_large` error event for its own request, whose entry
is acknowledged; the request is then reported refused (status `too_large`) so its owner stops it.
A dead letter keeps at most DEAD_LETTER_PREFIX_BYTES of the raw entry.

Entries are named by `EntryRef`s (worker/claims.py). What was written is reported through
`on_written(entries)`; what the script refused comes back through `on_refused(entry, status, detail)`: `lost` (another
worker owns the entry now) or `denied` (its reply address could not be written; the script has
acknowledged and dead-lettered it). The owner drops those requests.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from protocol import MAX_MESSAGE_BYTES, REQUEST_GROUP, Reply, encode, encode_progress, error_event
from protocol.keys import Shard
from protocol.progress import TOKEN_BYTES
from protocol.redis_client import UNREACHABLE, reply_text
from worker.claims import EntryRef, Lane
from worker.step_script import LUA

log = logging.getLogger(__name__)

REPLY_STREAM_MAXLEN = 10_000
DEAD_LETTER_MAXLEN = 10_000
KEY_TTL_S = 3600
RETRY_DELAY_S = 0.5
BATCH_HEADER_BYTES = 32  # a published batch's map, `v`, `events` and its array header: 18 bytes at most
MAX_EVENT_BYTES = MAX_MESSAGE_BYTES - BATCH_HEADER_BYTES  # also the most event bytes one PUBLISH carries
DEAD_LETTER_PREFIX_BYTES = 4096  # of a dead-lettered entry's raw msg: enough to identify it, never a copy of a huge one

Refused = Callable[[EntryRef, str, str], None]


@dataclass
class _EntryWrites:
    """What one step writes for one request stream entry."""

    reply: Reply | None = None
    events: list[bytes] = field(default_factory=list)
    request_id: str = ""  # names the progress and holder keys; "" for an entry that never ran
    progress_offset: int = 0  # tokens streamed before `progress`
    progress: list[int] = field(default_factory=list)
    finish: bool = False
    dead_letter: tuple[bytes, str, str] | None = None  # raw msg, code, message

    def arguments(self, shard: Shard, stream_number: int, entry_id: str) -> list[Any]:
        kind, key = (self.reply.kind, self.reply.key) if self.reply else ("", "")
        record: list[Any] = [stream_number, entry_id, kind, key, len(self.events), *self.events]
        keys = [shard.progress_key(self.request_id), shard.holder_key(self.request_id)] if self.request_id else ["", ""]
        record += [*keys, self.progress_offset * TOKEN_BYTES, encode_progress(self.progress)]
        record += ["1" if self.finish else "", "1" if self.dead_letter else ""]
        return record + list(self.dead_letter or ())


class Publisher:
    def __init__(
        self,
        redis: aioredis.Redis,
        lanes: list[Lane],
        consumer: str,
        on_refused: Refused | None = None,
        on_written: Callable[[list[EntryRef]], None] | None = None,
    ):
        self.redis = redis
        # Each write goes to its entry's own stream: the one of its lane.
        self.lanes = {lane.name: lane for lane in lanes}
        self.consumer = consumer
        self.on_refused = on_refused or (lambda entry, status, detail: None)
        self.on_written = on_written or (lambda entries: None)
        self._script = redis.register_script(LUA)
        # Step numbers are unique to this process, so a restarted worker with the same id starts afresh.
        self._process_token = secrets.token_hex(4)
        self._step = 0
        self._pending: dict[EntryRef, _EntryWrites] = {}
        self._too_large: dict[EntryRef, str] = {}  # entry -> why: failed by an oversize event, until reported refused
        self._wakeup = asyncio.Event()
        self._sent = asyncio.Event()
        self._sending = False
        self._in_flight: set[EntryRef] = set()  # entries of the writes being sent (retried while Redis is down)

    # ------------------------------------------------------------ writes (synchronous, never block)

    def send(self, entry: EntryRef, reply: Reply, event: dict[str, Any]) -> None:
        if entry in self._too_large:
            return
        data = encode(event)
        if len(data) > MAX_EVENT_BYTES:
            data = self._refuse_oversize(entry, event, len(data))
        writes = self._writes(entry)
        writes.reply = reply
        writes.events.append(data)

    def _refuse_oversize(self, entry: EntryRef, event: dict[str, Any], size: int) -> bytes:
        """An event too large for any message fails its own request: an error event in its place, the entry finished."""
        detail = f"the request's {event.get('type')} event is {size} bytes; one event may be at most {MAX_EVENT_BYTES}"
        log.warning("entry %s: %s", entry, detail)
        self._too_large[entry] = detail
        self._writes(entry).finish = True
        return encode(error_event(event.get("id"), event.get("seq", 0), "too_large", detail))

    def record_progress(self, entry: EntryRef, request_id: str, offset: int, token_ids: list[int]) -> None:
        """`token_ids` were streamed after the first `offset` completion tokens."""
        if entry in self._too_large:
            return
        writes = self._writes(entry)
        if not writes.progress:
            writes.request_id, writes.progress_offset = request_id, offset
        writes.progress.extend(token_ids)

    def finish(self, entry: EntryRef, request_id: str | None) -> None:
        """Acknowledge and delete the entry; forget the request's progress and holder."""
        writes = self._writes(entry)
        writes.finish = True
        writes.request_id = request_id or writes.request_id

    def dead_letter(self, entry: EntryRef, raw: bytes, code: str, message: str) -> None:
        if len(raw) > DEAD_LETTER_PREFIX_BYTES:
            message += f" (the entry's msg was {len(raw)} bytes; its first {DEAD_LETTER_PREFIX_BYTES} are kept)"
            raw = raw[:DEAD_LETTER_PREFIX_BYTES]
        self._writes(entry).dead_letter = (raw, code, message)

    def _writes(self, entry: EntryRef) -> _EntryWrites:
        self._wakeup.set()
        return self._pending.setdefault(entry, _EntryWrites())

    # ------------------------------------------------------------ the sending task

    async def run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            writes, self._pending = self._pending, {}
            self._sending, self._in_flight = True, set(writes)
            try:
                if writes:
                    await self._send(writes)
            finally:
                self._sending, self._in_flight = False, set()
            if not self._pending:
                self._sent.set()

    def writing(self, entry: EntryRef) -> bool:
        """Whether writes of `entry` are queued or on their way: until they land (they acknowledge it
        with the request's end), the entry is still this worker's, whatever the engine did with it."""
        return entry in self._pending or entry in self._in_flight

    async def flush(self) -> None:
        """Wait until everything added so far is written (the `run` task must be running)."""
        while self._pending or self._sending:
            self._sent.clear()
            await self._sent.wait()

    async def _send(self, writes: dict[EntryRef, _EntryWrites]) -> None:
        self._step += 1
        by_shard: dict[Shard, dict[EntryRef, _EntryWrites]] = {}
        for entry, entry_writes in writes.items():
            by_shard.setdefault(self.lanes[entry.lane].shard, {})[entry] = entry_writes
        await asyncio.gather(*(self._send_to_shard(shard, shard_writes) for shard, shard_writes in by_shard.items()))

    async def _send_to_shard(self, shard: Shard, writes: dict[EntryRef, _EntryWrites]) -> None:
        lanes = [lane for lane in self.lanes.values() if lane.shard == shard]
        stream_numbers = {lane.name: number for number, lane in enumerate(lanes, start=1)}
        keys = [
            shard.dead_letter_stream,
            shard.applied_step_key(self.consumer, self._process_token),
            *(lane.stream for lane in lanes),
        ]
        args: list[Any] = [
            REQUEST_GROUP,
            self.consumer,
            self._step,
            KEY_TTL_S,
            REPLY_STREAM_MAXLEN,
            DEAD_LETTER_MAXLEN,
            MAX_EVENT_BYTES,
        ]
        for entry, entry_writes in writes.items():
            args += entry_writes.arguments(shard, stream_numbers[entry.lane], entry.entry_id)
        while True:
            try:
                answer = await self._script(keys=keys, args=args)
                break
            except UNREACHABLE as exc:
                log.warning("redis unavailable (%s); retrying a step's writes", exc)
                await asyncio.sleep(RETRY_DELAY_S)
            except RedisError as exc:
                # Nothing was written: the requests are handed back to the group (another run takes them over).
                log.error("a step's writes were refused (%s); its %d requests are handed back", exc, len(writes))
                answer = [part for position in range(1, len(writes) + 1) for part in (position, "lost", str(exc))]
                break
        self._report(answer, list(writes))

    def _report(self, answer: list, entries: list[EntryRef]) -> None:
        """`answer` names entries by their position among the step's records (1-based)."""
        refused: set[EntryRef] = set()
        for index in range(0, len(answer), 3):
            position, status, detail = (reply_text(part) for part in answer[index : index + 3])
            entry = entries[int(position) - 1]
            if status == "orphan":
                log.warning("entry %s is pending for nobody (the group was reset?); its events still go out", entry)
                continue
            log.warning(
                "entry %s %s: %s", entry, "taken over by another worker" if status == "lost" else "refused", detail
            )
            refused.add(entry)
            self.on_refused(entry, status, detail)
        self.on_written([entry for entry in entries if entry not in refused])
        for entry in entries:
            detail = self._too_large.pop(entry, None)
            if detail is not None and entry not in refused:
                self.on_refused(entry, "too_large", detail)
