"""Sending a request's events again after a consumer's reply subscription broke (protocol/resume.py).

Pub/sub keeps nothing for a subscriber that is away: a gateway whose subscription broke (a Redis
restart, a Sentinel failover) missed what its requests' workers published meanwhile. This worker
still holds those requests, so it keeps what it sent for each (`SentEvents`) and, when a consumer
asks on `lmq:resume`, first re-establishes what the Redis it now talks to may lack (a promoted
replica that missed the last writes of the old primary): the entry pending for this worker, the
holder key, the progress record; then sends again every event after the one the consumer has, and
a `resumed` event. The consumer drops what it already relayed (by `seq`) and fills its gap.

Memory is bounded: each request keeps at most MAX_KEPT_BYTES of events (past it, its oldest are
dropped, and a resume that needs them gets an `unavailable` error: a visible end, never a hole); an
ended request is kept KEEP_ENDED_S (its `done` may be what was lost) and then forgotten; all
requests together keep at most MAX_TOTAL_BYTES (the ended ones go first).
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from protocol import REQUEST_GROUP, ProtocolError, Request, encode_progress, error_event
from protocol.redis_client import REDIS_FAILURES
from protocol.resume import Resume, decode_resume, resumed_event
from worker.claims import EntryRef, RequestStreams
from worker.publisher import KEY_TTL_S, Publisher

log = logging.getLogger(__name__)

MAX_KEPT_BYTES = 1 << 20  # one request's events, as estimated by _size: ~10 000 tokens of plain text
MAX_TOTAL_BYTES = 256 << 20
KEEP_ENDED_S = 60.0  # at least the gateways' LMQ_RESUME_TIMEOUT (15 s) plus an outage's length
HOLDER_MARGIN_S = 60

# Make the entry pending for this consumer again, and the holder and progress keys this entry's.
# Answers `ok`, `reclaimed` (the entry was pending for nobody: claimed with FORCE, and the group's
# last delivered id moved up to it so no other worker reads it as new), `orphan` (the
# entry or its group is gone: the request finishes from memory, no other worker could take it
# over), or `lost` (another consumer or another entry holds it now: nothing written).
REESTABLISH_LUA = r"""
local stream, holder, progress = KEYS[1], KEYS[2], KEYS[3]
local group, me, entry, handle = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local holder_ttl, tokens, progress_ttl = ARGV[5], ARGV[6], ARGV[7]
local function id_below(a, b)
  local am, as = a:match('^(%d+)-(%d+)$')
  local bm, bs = b:match('^(%d+)-(%d+)$')
  if tonumber(am) ~= tonumber(bm) then return tonumber(am) < tonumber(bm) end
  return tonumber(as) < tonumber(bs)
end
local status = 'ok'
local pending = redis.pcall('XPENDING', stream, group, entry, entry, 1)
if type(pending) == 'table' and pending.err then
  status = 'orphan'
elseif #pending == 1 then
  if pending[1][2] ~= me then return 'lost' end
elseif #redis.call('XRANGE', stream, entry, entry) == 1 then
  redis.call('XCLAIM', stream, group, me, 0, entry, 'FORCE', 'JUSTID')
  -- The read itself was lost, so the group would hand the entry out again as new: move its last
  -- delivered id up to it (what precedes it was read before it, on the old primary).
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local fields = {}
    for k = 1, #g, 2 do fields[g[k]] = g[k + 1] end
    if fields['name'] == group and id_below(fields['last-delivered-id'], entry) then
      redis.call('XGROUP', 'SETID', stream, group, entry)
    end
  end
  status = 'reclaimed'
else
  status = 'orphan'
end
local held = redis.call('GET', holder)
if held and held ~= handle then return 'lost' end
redis.call('SET', holder, handle, 'EX', holder_ttl)
if #tokens > 0 then
  redis.call('SETRANGE', progress, 0, tokens)
  redis.call('EXPIRE', progress, progress_ttl)
end
return status
"""


@dataclass
class _Kept:
    """What this worker sent for one request it runs (or ran)."""

    request: Request
    entry_id: EntryRef  # the entry (worker/claims.py)
    tokens: array  # completion tokens streamed so far (uint32), a dead worker's before this one's included
    events: deque[tuple[int, dict[str, Any], int]] = field(default_factory=deque)  # (seq, event, size)
    size: int = 0
    dropped_seq: int = -1  # the last seq dropped to stay within MAX_KEPT_BYTES (-1: none)
    dropped_offset: int = 0  # tokens before the first kept delta, when some were dropped
    tokens_before_run: int = 0  # streamed by a dead worker before this one took the request over
    ended_at: float | None = None

    @property
    def first_offset(self) -> int:
        """The completion tokens a consumer must have for the kept events to fill its gap."""
        return self.dropped_offset if self.dropped_seq >= 0 else self.tokens_before_run

    def last_seq(self, default: int) -> int:
        return self.events[-1][0] if self.events else default


class SentEvents:
    """The events sent for each request this worker holds, by request id."""

    def __init__(self) -> None:
        self._kept: dict[str, _Kept] = {}
        self._by_entry: dict[EntryRef, str] = {}
        self._ended: deque[tuple[float, str]] = deque()  # (ended at, request id), oldest first
        self.total = 0

    def started(self, request: Request, entry_id: EntryRef, streamed: list[int]) -> None:
        self.forget(request.id)
        self._kept[request.id] = _Kept(request, entry_id, array("I", streamed), tokens_before_run=len(streamed))
        self._by_entry[entry_id] = request.id

    def sent(self, entry_id: EntryRef, event: dict[str, Any]) -> None:
        kept = self._of_entry(entry_id)
        if kept is None:
            return
        size = _size(event)
        kept.events.append((int(event.get("seq", 0)), event, size))
        kept.size += size
        self.total += size
        if event.get("type") == "delta":
            kept.tokens.extend(event.get("token_ids") or ())
        while kept.size > MAX_KEPT_BYTES and kept.events:
            self._drop_oldest(kept)
        self._trim(time.monotonic())

    def ended(self, entry_id: EntryRef) -> None:
        kept = self._of_entry(entry_id)
        if kept is not None and kept.ended_at is None:
            kept.ended_at = time.monotonic()
            self._ended.append((kept.ended_at, kept.request.id))

    def forget_entry(self, entry_id: EntryRef) -> None:
        """The entry is no longer this worker's (taken over, refused): nothing of it may be sent again."""
        request_id = self._by_entry.get(entry_id)
        if request_id is not None:
            self.forget(request_id)

    def forget(self, request_id: str) -> None:
        kept = self._kept.pop(request_id, None)
        if kept is not None:
            self._by_entry.pop(kept.entry_id, None)
            self.total -= kept.size

    def get(self, request_id: str) -> _Kept | None:
        self._trim(time.monotonic())
        return self._kept.get(request_id)

    def _of_entry(self, entry_id: EntryRef) -> _Kept | None:
        request_id = self._by_entry.get(entry_id)
        return self._kept.get(request_id) if request_id is not None else None

    def _drop_oldest(self, kept: _Kept) -> None:
        seq, event, size = kept.events.popleft()
        kept.size -= size
        self.total -= size
        kept.dropped_seq = seq
        if event.get("type") == "delta":
            kept.dropped_offset = int(event.get("offset", 0)) + len(event.get("token_ids") or [])

    def _trim(self, now: float) -> None:
        """Forget ended requests past KEEP_ENDED_S, and the oldest ended ones while over MAX_TOTAL_BYTES."""
        while self._ended and (self._ended[0][0] < now - KEEP_ENDED_S or self.total > MAX_TOTAL_BYTES):
            ended_at, request_id = self._ended.popleft()
            kept = self._kept.get(request_id)
            if kept is not None and kept.ended_at == ended_at:
                self.forget(request_id)


def _size(event: dict[str, Any]) -> int:
    """About the bytes an event holds in memory (cheap: no encoding on the step's path)."""
    size = 96 + 4 * len(event.get("text") or "") + 8 * len(event.get("token_ids") or [])
    for entry in event.get("logprobs") or ():
        size += 64 * (1 + len(entry.get("top") or ()))
    return size


class RecordingPublisher(Publisher):
    """The step publisher, keeping what it sends for each request in `sent_events`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sent_events = SentEvents()

    def send(self, entry_id: EntryRef, reply, event: dict[str, Any]) -> None:
        super().send(entry_id, reply, event)
        self.sent_events.sent(entry_id, event)

    def finish(self, entry_id: EntryRef, request_id: str | None) -> None:
        super().finish(entry_id, request_id)
        self.sent_events.ended(entry_id)

    def send_again(self, entry_id: EntryRef, reply, event: dict[str, Any]) -> None:
        """Send an event without keeping it a second time."""
        super().send(entry_id, reply, event)


class Resumer:
    """Answers resume messages for the requests this worker holds."""

    def __init__(self, redis: aioredis.Redis, streams: RequestStreams, publisher: RecordingPublisher, consumer: str):
        self.redis = redis
        self.streams = streams
        self.publisher = publisher
        self.consumer = consumer
        self._script = redis.register_script(REESTABLISH_LUA)
        self._tasks: set[asyncio.Task] = set()

    def on_message(self, raw: bytes) -> None:
        """A message on lmq:resume: answered in its own task (re-establishing takes a round trip)."""
        try:
            resume = decode_resume(raw)
        except ProtocolError as exc:
            log.info("ignored a malformed resume: %s", exc)
            return
        kept = self.publisher.sent_events.get(resume.id)
        if kept is None or kept.request.cancel_digest != resume.digest:
            return  # another worker's request (or one that ended long ago), or a resume without its token
        task = asyncio.create_task(self.resume(resume), name=f"resume:{resume.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def resume(self, resume: Resume) -> None:
        kept = self.publisher.sent_events.get(resume.id)
        if kept is None:
            return
        if kept.ended_at is None:
            try:
                status = await self._reestablish(kept)
            except REDIS_FAILURES as exc:
                log.warning(
                    "request_id=%s: could not re-establish it for a resume (%s); the consumer asks again",
                    resume.id,
                    exc,
                )
                return
            if status == "lost":
                log.info("request_id=%s: another worker holds it now; its resume is theirs", resume.id)
                return
            if status != "ok":
                log.warning(
                    "request_id=%s: re-established for a resume (%s)",
                    resume.id,
                    status,
                    extra={"request_id": resume.id},
                )
            kept = self.publisher.sent_events.get(resume.id)
            if kept is None:
                return
        self._send_again(kept, resume)

    async def _reestablish(self, kept: _Kept) -> str:
        lane = self.streams.lane_of(kept.entry_id)
        shard = lane.shard
        request = kept.request
        ttl = max(int(request.deadline - time.time()), 0) + HOLDER_MARGIN_S
        keys = [lane.stream, shard.holder_key(request.id), shard.progress_key(request.id)]
        args = [
            REQUEST_GROUP,
            self.consumer,
            kept.entry_id.entry_id,
            str(kept.entry_id),  # the holder's value: the entry's name, as the step script writes it
            ttl,
            encode_progress(kept.tokens.tolist()),
            KEY_TTL_S,
        ]
        status = await self._script(keys=keys, args=args)
        return status.decode() if isinstance(status, bytes) else str(status)

    def _send_again(self, kept: _Kept, resume: Resume) -> None:
        request = kept.request
        if resume.seq < kept.dropped_seq or resume.offset < kept.first_offset:
            message = "the connection to the request queue broke and the part of the answer that was lost is no longer kept; retry"
            log.warning(
                "request_id=%s: cannot resume after seq %d (kept from seq %d, offset %d)",
                request.id,
                resume.seq,
                kept.dropped_seq + 1,
                kept.first_offset,
            )
            self.publisher.send_again(
                kept.entry_id,
                request.reply,
                error_event(request.id, kept.last_seq(resume.seq) + 1, "unavailable", message),
            )
            return
        again = [event for seq, event, _ in kept.events if seq > resume.seq]
        for event in again:
            self.publisher.send_again(kept.entry_id, request.reply, event)
        self.publisher.send_again(
            kept.entry_id, request.reply, resumed_event(request.id, kept.last_seq(resume.seq), len(kept.tokens))
        )
        if kept.ended_at is not None:  # the finish may be what the new primary lacks: acknowledge again (idempotent)
            Publisher.finish(self.publisher, kept.entry_id, request.id)
        log.info(
            "request_id=%s: resumed after seq %d: %d events sent again",
            request.id,
            resume.seq,
            len(again),
            extra={"request_id": request.id},
        )
