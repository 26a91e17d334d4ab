"""The request streams seen by one consumer of the `workers` group: read, claim, keep, count.

`RequestStream` is one stream. A worker reads one stream per priority in each shard
(protocol/keys.py: `lmq:req:<model>` and `lmq:req-batch:<model>` on one Redis; the same in each of
K hash-tagged shards on a cluster): a `Lane` each. `RequestStreams` holds them behind one
interface. Streams number their entries independently, so the same id can exist in two: a worker
names an entry by an `EntryRef` (its lane and its id), and every write or acknowledgement goes to
the ref's own stream (worker/publisher.py does the same).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol import REQUEST_GROUP
from protocol.keys import BATCH, INTERACTIVE, UNSHARDED, Shard, ShardLayout
from protocol.redis_client import reply_text
from protocol.request_groups import create_request_group
from worker.step_script import KEEP_LUA

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EntryRef:
    """A request stream entry among a worker's lanes: the lane (`Lane.name`) whose stream holds it, and its id."""

    lane: str
    entry_id: str

    def __str__(self) -> str:
        """For log lines: the plain id in the home shard's interactive lane, else `<lane>/<id>`."""
        return self.entry_id if self.lane == INTERACTIVE else f"{self.lane}/{self.entry_id}"


@dataclass(frozen=True)
class Entry:
    """One request stream entry: where it is and its raw fields (bytes keys and values)."""

    ref: EntryRef
    fields: dict[bytes, bytes]

    @property
    def entry_id(self) -> str:
        return self.ref.entry_id


FIRST_ID = "0-0"  # older than every entry


@dataclass(frozen=True)
class Read:
    """What one read of a stream found: the entries now delivered to this consumer, the stream's newest
    id at that moment, and whether nothing was left undelivered then (entries beyond `up_to` included)."""

    entries: list[Entry]
    newest: str
    drained: bool


# Deliver to ARGV[2] up to ARGV[3] entries never delivered to anyone: with ARGV[4] ("" = no limit) only
# those no newer than that id, counted first (XRANGE from the group's last delivered id), so XREADGROUP
# delivers no entry beyond it. Answers {the stream's newest id, 1 if nothing is left undelivered, the
# entries}. A missing stream or group answers NOGROUP, as XREADGROUP would (worker/service.py recreates it).
READ_LUA = r"""
local stream, group, me, count, up_to = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local top = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
local newest = top[1] and top[1][1] or '0-0'
local function deliver(n)
  local got = redis.pcall('XREADGROUP', 'GROUP', group, me, 'COUNT', n, 'STREAMS', stream, '>')
  if type(got) == 'table' and got.err then return nil, got end
  return got and got[1] and got[1][2] or {}
end
if up_to == '' then
  local entries, err = deliver(count)
  if err then return err end
  return {newest, #entries < count and 1 or 0, entries}
end
local groups = redis.pcall('XINFO', 'GROUPS', stream)
local last
if type(groups) == 'table' and not groups.err then
  for _, fields in ipairs(groups) do
    local named = {}
    for k = 1, #fields, 2 do named[fields[k]] = fields[k + 1] end
    if named['name'] == group then last = named['last-delivered-id'] end
  end
end
if not last then return redis.error_reply("NOGROUP No such key '" .. stream .. "' or consumer group '" .. group .. "'") end
local entries = {}
local waiting = #redis.call('XRANGE', stream, '(' .. last, up_to, 'COUNT', count)
if waiting > 0 then
  local err
  entries, err = deliver(waiting)
  if err then return err end
  last = entries[#entries][1]
end
local left = redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', 1)
return {newest, #left == 0 and 1 or 0, entries}
"""


def _fields(flat: list[bytes] | None) -> dict[bytes, bytes]:
    """An entry's fields as a script answers them (a flat list), as XREADGROUP's client answers them."""
    flat = flat or []
    return dict(zip(flat[::2], flat[1::2]))


def is_missing_group(error: ResponseError) -> bool:
    """The stream or its group is gone (FLUSHALL, a Redis restarted without persistence, a deleted key)."""
    return str(error).startswith("NOGROUP")


class RequestStream:
    """One stream; its entries come out named in `lane` (a worker's `Lane.name` for the stream)."""

    def __init__(self, redis: aioredis.Redis, stream: str, consumer: str, lane: str = INTERACTIVE):
        self.redis = redis
        self.stream = stream
        self.consumer = consumer
        self.lane = lane
        self._keep = redis.register_script(KEEP_LUA)
        self._read = redis.register_script(READ_LUA)

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream); whoever starts first does it."""
        await create_request_group(self.redis, self.stream)

    async def read_new(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` entries never delivered to anyone, waiting at most `block_ms` (None: not at all)."""
        reply = await self.redis.xreadgroup(
            REQUEST_GROUP, self.consumer, {self.stream: ">"}, count=count, block=block_ms
        )
        return [self._entry(entry_id, fields) for entry_id, fields in reply[0][1]] if reply else []

    async def read_available(self, count: int, up_to: str | None = None) -> Read:
        """Up to `count` entries never delivered to anyone, without waiting; with `up_to`, only those no
        newer than that id. One script call (`READ_LUA`): what it delivers, the stream's newest id and
        whether anything is left undelivered are one moment's, so a caller that found nothing and was
        told nothing is left may wait beyond `newest` (`wait_beyond`) and miss no entry: any entry
        added since is newer (stream ids only grow)."""
        newest, drained, entries = await self._read(
            keys=[self.stream], args=[REQUEST_GROUP, self.consumer, count, up_to or ""]
        )
        return Read(
            [self._entry(entry_id, _fields(flat)) for entry_id, flat in entries], reply_text(newest), bool(drained)
        )

    async def wait_beyond(self, mark: str, block_ms: int) -> str | None:
        """Until the stream has an entry newer than `mark`, or `block_ms` passed: the first such entry's id,
        or None. Takes nothing: a plain XREAD, outside the group, so a worker waiting for work promises none
        of its slots to it."""
        reply = await self.redis.xread({self.stream: mark}, count=1, block=block_ms)
        return reply_text(reply[0][1][0][0]) if reply and reply[0][1] else None

    async def claim_idle(self, min_idle_ms: int, count: int) -> list[Entry]:
        """Take over up to `count` entries that other consumers left idle for `min_idle_ms`.

        An entry deleted while pending (its client withdrew it) has nothing left to run. Redis 7+
        drops it from the pending list itself; Redis 6.2 claims it and answers `(nil, nil)`, so we
        find it among our pending entries and acknowledge it.
        """
        reply = await self.redis.xautoclaim(
            self.stream, REQUEST_GROUP, self.consumer, min_idle_ms, start_id="0-0", count=count
        )
        claimed = [self._entry(entry_id, fields) for entry_id, fields in reply[1] if entry_id is not None]
        if len(claimed) < len(reply[1]):
            await self._acknowledge_withdrawn()
        return claimed

    def _entry(self, entry_id: bytes | str, fields: dict[bytes, bytes] | None) -> Entry:
        return Entry(EntryRef(self.lane, reply_text(entry_id)), fields or {})

    async def _acknowledge_withdrawn(self) -> None:
        pending = await self.redis.xpending_range(
            self.stream, REQUEST_GROUP, min="-", max="+", count=1000, consumername=self.consumer
        )
        ids = [reply_text(item["message_id"]) for item in pending]
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
        return [reply_text(entry_id) for entry_id in lost]

    async def delivery_count(self, entry_id: str) -> int:
        """How many times the entry was delivered (read or claimed); 0 when it is no longer pending."""
        pending = await self.redis.xpending_range(self.stream, REQUEST_GROUP, min=entry_id, max=entry_id, count=1)
        return pending[0]["times_delivered"] if pending else 0


@dataclass(frozen=True)
class Lane:
    """One stream a worker reads: the requests of one priority in one shard."""

    priority: str
    stream: str
    shard: Shard = UNSHARDED

    @property
    def name(self) -> str:
        """Unique among a worker's lanes, without '/': the priority, plus `@<shard>` beyond the home shard."""
        return self.priority if self.shard.index == 0 else f"{self.priority}@{self.shard.index}"


def model_lanes(layout: ShardLayout, model: str) -> list[Lane]:
    """The lanes of a worker serving `model`, in the order they are served: every shard's interactive
    stream, then every shard's batch stream."""
    return [
        Lane(priority, shard.request_stream(model, priority), shard)
        for priority in (INTERACTIVE, BATCH)
        for shard in layout.shards
    ]


class RequestStreams:
    """One consumer's view of its model's lanes, in the order they are served.

    Entries come out named by `EntryRef`s; every method that takes refs sends each to its own stream."""

    def __init__(self, redis: aioredis.Redis, lanes: list[Lane], consumer: str):
        self.lanes = {lane.name: lane for lane in lanes}
        self.by_lane = {lane.name: RequestStream(redis, lane.stream, consumer, lane.name) for lane in lanes}

    @property
    def stream(self) -> str:
        """The streams' names, for log lines."""
        return " + ".join(lane.stream for lane in self.lanes.values())

    def lane_of(self, entry: EntryRef) -> Lane:
        return self.lanes[entry.lane]

    async def ensure_group(self) -> None:
        for stream in self.by_lane.values():
            await stream.ensure_group()

    async def read_new(self, lane: str, count: int, block_ms: int) -> list[Entry]:
        """Up to `count` new entries of one lane's stream (each lane has its own reader)."""
        return await self.by_lane[lane].read_new(count, block_ms)

    async def read_available(self, lane: str, count: int, up_to: str | None = None) -> Read:
        """Up to `count` new entries of one lane's stream (no newer than `up_to`), without waiting (`RequestStream.read_available`)."""
        return await self.by_lane[lane].read_available(count, up_to)

    async def wait_beyond(self, lane: str, mark: str, block_ms: int) -> str | None:
        return await self.by_lane[lane].wait_beyond(mark, block_ms)

    async def claim_idle(self, min_idle_ms: int, counts: dict[str, int]) -> list[Entry]:
        """Take over idle entries, up to `counts[priority]` of each priority over all its lanes, interactive ones first."""
        left = dict(counts)
        claimed: list[Entry] = []
        for name, lane in self.lanes.items():
            if left.get(lane.priority, 0) > 0:
                taken = await self.by_lane[name].claim_idle(min_idle_ms, left[lane.priority])
                left[lane.priority] -= len(taken)
                claimed += taken
        return claimed

    async def keep(self, entries: list[EntryRef]) -> list[EntryRef]:
        """Reset the idle time of the entries this consumer still owns; the ones another consumer took over."""
        lost: list[EntryRef] = []
        for lane, entry_ids in _by_lane(entries).items():
            lost += [EntryRef(lane, entry_id) for entry_id in await self.by_lane[lane].keep(entry_ids)]
        return lost

    async def delivery_count(self, entry: EntryRef) -> int:
        return await self.by_lane[entry.lane].delivery_count(entry.entry_id)


def _by_lane(entries: list[EntryRef]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for entry in entries:
        grouped.setdefault(entry.lane, []).append(entry.entry_id)
    return grouped
