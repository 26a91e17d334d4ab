"""Batches and files in Redis: everything a gateway needs to drive a batch, so any gateway can.

Keys (spelled by the home shard, protocol/keys.py; on one Redis the names below, on a Redis
Cluster the same with the home shard's hash tag: `lmq:{<tag>}:batch:<id>`, ...):

    lmq:batch:<id>            hash    the batch: api, status, timestamps, counts, next item to enqueue
    lmq:batch:<id>:items      list    one JSON object per item ({custom_id, url, body}), in input order
    lmq:batch:<id>:inflight   hash    item index -> "<attempt> <request stream> <entry id>": its run in the queue
    lmq:batch:<id>:results    hash    item index -> the item's outcome (JSON), written once (HSETNX)
    lmq:batch:<id>:lease      string  the gateway driving the batch (SET NX PX, renewed while it drives)
    lmq:batches:<api>[:<owner>] zset  batch ids by creation time, for listing, one index per owner
    lmq:batches-active        set     batches not ended yet: what gateways look for work in
    lmq:file:<id>             hash    a file's metadata      lmq:file:<id>:data  string: its bytes
    lmq:files[:<owner>]       zset    file ids by creation time, one index per owner

Every file and batch has an owner, the `owner` field of its hash: the digest of the API key that
created it (gateway/auth.py: a hash, never the key), or "" on a gateway that takes no keys (one
anonymous owner, whose indexes keep the names above without a suffix). A record is found only by
its owner (`file`, `batch` answer None to anyone else: the handlers' 404), and lists read the
owner's own index. Ids are checked against the shapes `new_id` makes before they name a key
(`valid_id`), so a URL cannot name another kind of key (`<id>:data`).

Every change that must not happen twice is one Lua script: enqueueing an item checks the lease,
the batch's status and that the item is the next one (or the attempt it retries is the one in
flight) before it XADDs; recording an outcome is HSETNX, and the counts move only when that
wrote. So two gateways that both believe they drive a batch (one stalled past its lease) enqueue
nothing twice and count nothing twice. Ended batches and files expire after `RETENTION_S`.

Everything here lives in the home shard, and so do the runs of batch items: an item's request
goes to the home shard's batch stream (`home.request_stream(model, "batch")`), whatever shard its
request id would hash to, and its events to a reply stream of the home shard. The enqueue script
XADDs the item and records it in the batch's hashes in one step, and the worker's step script
writes the reply stream in the same step as it acknowledges the entry: on a cluster a script may
only touch keys of one hash slot, so the batch, its request stream and its reply streams must
share one. The other writes that must land together (a file's or a batch's record and its index
entries, a batch's end) are scripts too, over one batch's or one file's keys and the home indexes:
one slot, and no MULTI, whose EXEC a cluster client could send to a node that no longer serves it.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

import protocol
from protocol.keys import Shard
from protocol.redis_client import reply_text
from protocol.request_groups import RequestGroups

from ..leased_drivers import LeaseKeys

RETENTION_S = 30 * 86_400  # ended batches, their results and files are kept this long (OpenAI: 30 days)
CHUNK = 1000  # items per Redis command when writing or reading many
OUTCOMES = ("succeeded", "errored", "canceled", "expired")
ENDED = ("completed", "failed", "cancelled", "expired")  # statuses (OpenAI's names) after which nothing runs

ENQUEUE_LUA = r"""
-- KEYS = [batch, inflight, lease, request stream]; ARGV = [gateway, index, attempt, msg, attempt it retries or ""]
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return false end
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return false end
if ARGV[5] == '' then
  if tonumber(redis.call('HGET', KEYS[1], 'next') or '-1') ~= tonumber(ARGV[2]) then return false end
  redis.call('HINCRBY', KEYS[1], 'next', 1)
else
  local current = redis.call('HGET', KEYS[2], ARGV[2])
  if not current or string.match(current, '^%S+') ~= ARGV[5] then return false end
end
if ARGV[4] == '' then return 'skipped' end  -- an item that cannot run: its outcome is written already
local entry = redis.call('XADD', KEYS[4], '*', 'msg', ARGV[4])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3] .. ' ' .. KEYS[4] .. ' ' .. entry)
return entry
"""

OWED = "owed:"  # a batch hash field per item whose tokens are not charged to the owner yet
RECORD_LUA = r"""
-- KEYS = [batch, inflight, results]
-- ARGV = [index, outcome JSON, outcome, attempt or "", prompt, completion, cached tokens, tokens owed to the owner]
if ARGV[4] ~= '' then
  local current = redis.call('HGET', KEYS[2], ARGV[1])
  if current and string.match(current, '^%S+') ~= ARGV[4] then return 0 end
end
local wrote = redis.call('HSETNX', KEYS[3], ARGV[1], ARGV[2]) == 1
if wrote then
  redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
  redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[5])
  redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[6])
  redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[7])
  if tonumber(ARGV[8]) > 0 then redis.call('HSET', KEYS[1], 'owed:' .. ARGV[1], ARGV[8]) end
end
redis.call('HDEL', KEYS[2], ARGV[1])
return wrote and 2 or 1  -- 2: this call wrote the outcome
"""

RECORD_NEVER_RAN_LUA = r"""
-- KEYS = [batch, inflight, results]; ARGV = [index, outcome JSON, outcome, index, ...]: items that never ran
for i = 1, #ARGV, 3 do
  if redis.call('HSETNX', KEYS[3], ARGV[i], ARGV[i + 1]) == 1 then redis.call('HINCRBY', KEYS[1], ARGV[i + 2], 1) end
  redis.call('HDEL', KEYS[2], ARGV[i])
end
return 1
"""

CANCEL_LUA = r"""
-- KEYS = [batch]; ARGV = [now]: validating or in_progress -> cancelling; answers the status after
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'validating' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
  return 'cancelling'
end
return status
"""


# The writes that must land together, each one script (one slot: the home shard's): a MULTI on a
# cluster client is sent where its slot map says, and the map can change between a refresh and EXEC.
RECORD_FILE_LUA = r"""
-- KEYS = [file hash, owner's file index]; ARGV = [file id, created, retention s, field, value, ...]
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""

DELETE_FILE_LUA = r"""
-- KEYS = [file hash, file data, owner's file index]; ARGV = [file id]: how many of the two keys were there
local deleted = redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
return deleted
"""

CREATE_BATCH_LUA = r"""
-- KEYS = [batch hash, owner's batch index, active batches]; ARGV = [batch id, created, field, value, ...]
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

DELETE_BATCH_LUA = r"""
-- KEYS = [batch, items, inflight, results, lease, owner's batch index, active batches]; ARGV = [batch id]
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
redis.call('ZREM', KEYS[6], ARGV[1])
redis.call('SREM', KEYS[7], ARGV[1])
return 1
"""

ENDED_LUA = r"""
-- KEYS = [batch, items, results, inflight, active batches]; ARGV = [batch id, retention s, field, value, ...]
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
redis.call('SREM', KEYS[5], ARGV[1])
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[2]) end
redis.call('DEL', KEYS[4])
return 1
"""

GONE_LUA = r"""
-- KEYS = the request streams of runs; ARGV = [group, their entry ids]: 1 for each entry that is
-- neither in its stream nor pending (it ended, or was withdrawn before a worker read it), else 0
local gone = {}
for i, stream in ipairs(KEYS) do
  local entry = ARGV[i + 1]
  local present = #redis.call('XRANGE', stream, entry, entry) > 0
  if not present then
    local pending = redis.pcall('XPENDING', stream, ARGV[1], entry, entry, 1)
    present = type(pending) == 'table' and not pending.err and #pending > 0
  end
  gone[i] = present and 0 or 1
end
return gone
"""


ID_PATTERNS = {
    "file": re.compile(r"file-[0-9a-f]{24}(-output|-errors)?"),  # uploads, and a batch's output and error files
    "openai": re.compile(r"batch_[0-9a-f]{24}"),
    "anthropic": re.compile(r"msgbatch_[0-9a-f]{24}"),
}


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def valid_id(kind: str, text: str) -> bool:
    """`text` has the shape of an id this store makes for `kind` ("file", "openai", "anthropic")."""
    return ID_PATTERNS[kind].fullmatch(text) is not None


@dataclass
class Run:
    """An item's run in the queue: which attempt, and where its entry is."""

    attempt: int
    stream: str
    entry_id: str


@dataclass
class Batch:
    id: str
    fields: dict[str, str]

    @classmethod
    def from_hash(cls, batch_id: str, raw: dict) -> Batch:
        return cls(batch_id, {reply_text(k): reply_text(v) for k, v in raw.items()})

    @property
    def api(self) -> str:
        return self.fields["api"]

    @property
    def status(self) -> str:
        return self.fields["status"]

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    def number(self, name: str) -> int:
        return int(self.fields.get(name) or 0)

    def time(self, name: str) -> float | None:
        value = self.fields.get(name)
        return float(value) if value else None

    @property
    def total(self) -> int:
        return self.number("total")

    @property
    def finished(self) -> int:
        return sum(self.number(outcome) for outcome in OUTCOMES)

    def json(self, name: str) -> Any:
        value = self.fields.get(name)
        return json.loads(value) if value else None

    @property
    def owner(self) -> str:
        return self.fields.get("owner", "")


@dataclass
class FileRecord:
    id: str
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return int(self.fields.get("bytes") or 0)

    @property
    def owner(self) -> str:
        return self.fields.get("owner", "")


class BatchStore:
    def __init__(self, redis: aioredis.Redis, home: Shard):
        self.redis = redis
        self.home = home  # the shard of every key here (see the module's docstring)
        self._enqueue = redis.register_script(ENQUEUE_LUA)
        self._record = redis.register_script(RECORD_LUA)
        self._record_never_ran = redis.register_script(RECORD_NEVER_RAN_LUA)
        self._cancel = redis.register_script(CANCEL_LUA)
        self._leases = LeaseKeys(redis)
        self._gone = redis.register_script(GONE_LUA)
        self._record_file = redis.register_script(RECORD_FILE_LUA)
        self._delete_file = redis.register_script(DELETE_FILE_LUA)
        self._create_batch = redis.register_script(CREATE_BATCH_LUA)
        self._delete_batch = redis.register_script(DELETE_BATCH_LUA)
        self._ended = redis.register_script(ENDED_LUA)
        self.groups = RequestGroups(redis)

    # ------------------------------------------------------------ files

    def file_index(self, owner: str) -> str:
        return f"{self.home.file_index}:{owner}" if owner else self.home.file_index

    def batch_index(self, api: str, owner: str) -> str:
        return f"{self.home.batch_index(api)}:{owner}" if owner else self.home.batch_index(api)

    async def create_file(self, prefix: str, owner: str, fields: dict[str, Any], data: bytes | bytearray) -> FileRecord:
        """The bytes first, a MiB a command (one 64 MiB command held the gateway's loop for half a second
        as it was copied into the socket's buffer), then the metadata that makes the file visible."""
        file_id = new_id(prefix)
        created = int(time.time())
        record = {
            **{k: str(v) for k, v in fields.items()},
            "owner": owner,
            "bytes": str(len(data)),
            "created_at": str(created),
        }
        data_key, view = self.home.file_key(file_id, "data"), memoryview(data)
        await self.redis.set(data_key, b"", ex=RETENTION_S)
        for start in range(0, len(view), 1 << 20):
            await self.redis.append(data_key, view[start : start + (1 << 20)])
        await self._record_file_fields(file_id, owner, created, record)
        return FileRecord(file_id, record)

    async def write_generated_file(
        self, file_id: str, owner: str, fields: dict[str, Any], lines: AsyncIterator[bytes]
    ) -> FileRecord:
        """A file the gateway writes (a batch's output) under a name it chose, appended about a MiB at a
        time; written whole again if it existed (a gateway that took over a batch mid-way)."""
        data_key = self.home.file_key(file_id, "data")
        await self.redis.set(data_key, b"", ex=RETENTION_S)
        size, buffer = 0, bytearray()
        async for line in lines:
            buffer += line
            if len(buffer) >= 1 << 20:
                size += await self._append(data_key, buffer)
        size += await self._append(data_key, buffer)
        created = int(time.time())
        record = {
            **{k: str(v) for k, v in fields.items()},
            "owner": owner,
            "bytes": str(size),
            "created_at": str(created),
        }
        await self._record_file_fields(file_id, owner, created, record)
        return FileRecord(file_id, record)

    async def _record_file_fields(self, file_id: str, owner: str, created: int, record: dict[str, str]) -> None:
        """The metadata that makes a file visible, and its index entry, in one step."""
        keys = [self.home.file_key(file_id), self.file_index(owner)]
        await self._record_file(keys=keys, args=[file_id, created, RETENTION_S, *_pairs(record)])

    async def _append(self, key: str, buffer: bytearray) -> int:
        size = len(buffer)
        if size:
            await self.redis.append(key, bytes(buffer))
            buffer.clear()
        return size

    async def file(self, file_id: str, owner: str) -> FileRecord | None:
        """The file if `owner` owns it (None for a malformed id, a missing file, or another owner's)."""
        if not valid_id("file", file_id):
            return None
        raw = await self.redis.hgetall(self.home.file_key(file_id))
        record = FileRecord(file_id, {reply_text(k): reply_text(v) for k, v in raw.items()}) if raw else None
        return record if record is not None and record.owner == owner else None

    async def file_chunks(self, file_id: str, chunk_bytes: int = 1 << 20) -> AsyncIterator[bytes]:
        key, start = self.home.file_key(file_id, "data"), 0
        while True:
            chunk = await self.redis.getrange(key, start, start + chunk_bytes - 1)
            if not chunk:
                return
            yield chunk
            start += len(chunk)

    async def file_data(self, file_id: str) -> bytearray:
        """The file's bytes, read a MiB a command (the loop never holds one 64 MiB reply)."""
        data = bytearray()
        async for chunk in self.file_chunks(file_id):
            data += chunk
        return data

    async def delete_file(self, record: FileRecord) -> bool:
        keys = [self.home.file_key(record.id), self.home.file_key(record.id, "data"), self.file_index(record.owner)]
        return bool(await self._delete_file(keys=keys, args=[record.id]))

    async def files(self, owner: str, after: str | None, limit: int) -> tuple[list[FileRecord], bool]:
        ids, has_more = await self._page(self.file_index(owner), after, None, limit)
        records = [await self.file(file_id, owner) for file_id in ids]
        return [record for record in records if record is not None], has_more

    # ------------------------------------------------------------ batches

    async def create_batch(self, prefix: str, api: str, owner: str, fields: dict[str, Any], items: list[str]) -> Batch:
        """Items first, then the batch and its index entries in one script: a gateway never
        finds an active batch without its items."""
        batch_id = new_id(prefix)
        for start in range(0, len(items), CHUNK):
            await self.redis.rpush(self.home.batch_key(batch_id, "items"), *items[start : start + CHUNK])
        now = time.time()
        record = {
            **{k: str(v) for k, v in fields.items() if v is not None},
            "api": api,
            "owner": owner,
            "created_at": repr(now),
            "total": str(len(items)),
            "next": "0",
        }
        keys = [self.home.batch_key(batch_id), self.batch_index(api, owner), self.home.active_batches]
        await self._create_batch(keys=keys, args=[batch_id, repr(now), *_pairs(record)])
        return Batch(batch_id, record)

    async def batch(self, batch_id: str) -> Batch | None:
        """The batch, whoever owns it: for the runner, which drives every owner's batches."""
        raw = await self.redis.hgetall(self.home.batch_key(batch_id))
        return Batch.from_hash(batch_id, raw) if raw else None

    async def owned_batch(self, batch_id: str, api: str, owner: str) -> Batch | None:
        """The batch of `api` if `owner` owns it (None for a malformed id, a missing batch, or another owner's)."""
        if not valid_id(api, batch_id):
            return None
        batch = await self.batch(batch_id)
        return batch if batch is not None and batch.api == api and batch.owner == owner else None

    async def batches(
        self, api: str, owner: str, after: str | None, before: str | None, limit: int
    ) -> tuple[list[Batch], bool]:
        index = self.batch_index(api, owner)
        ids, has_more = await self._page(index, after, before, limit)
        found = []
        for batch_id in ids:
            batch = await self.owned_batch(batch_id, api, owner)
            if batch is None:  # expired: drop it from the index as we go
                await self.redis.zrem(index, batch_id)
            else:
                found.append(batch)
        return found, has_more

    async def update(self, batch_id: str, **fields: Any) -> None:
        await self.redis.hset(self.home.batch_key(batch_id), mapping={k: str(v) for k, v in fields.items()})

    async def cancel(self, batch_id: str) -> str:
        """Ask for cancellation; the batch's status afterwards."""
        return reply_text(await self._cancel(keys=[self.home.batch_key(batch_id)], args=[repr(time.time())]))

    async def delete_batch(self, batch: Batch) -> None:
        parts = ("", "items", "inflight", "results", "lease")
        keys = [self.home.batch_key(batch.id, part) for part in parts]
        keys += [self.batch_index(batch.api, batch.owner), self.home.active_batches]
        await self._delete_batch(keys=keys, args=[batch.id])

    async def ended(self, batch_id: str, **fields: Any) -> None:
        """The batch's last status: off the active set, and kept for `RETENTION_S`."""
        keys = [self.home.batch_key(batch_id, part) for part in ("", "items", "results", "inflight")]
        keys.append(self.home.active_batches)
        await self._ended(keys=keys, args=[batch_id, RETENTION_S, *_pairs({k: str(v) for k, v in fields.items()})])

    async def active(self) -> list[str]:
        return sorted(reply_text(member) for member in await self.redis.smembers(self.home.active_batches))

    async def items(self, batch_id: str, start: int, count: int) -> list[dict[str, Any]]:
        return [
            json.loads(raw)
            for raw in await self.redis.lrange(self.home.batch_key(batch_id, "items"), start, start + count - 1)
        ]

    async def results(self, batch_id: str, total: int) -> AsyncIterator[tuple[int, dict[str, Any] | None]]:
        """(index, outcome or None) of every item, in input order."""
        for start in range(0, total, CHUNK):
            indices = list(range(start, min(total, start + CHUNK)))
            raws = await self.redis.hmget(self.home.batch_key(batch_id, "results"), indices)
            for index, raw in zip(indices, raws):
                yield index, json.loads(raw) if raw else None

    # ------------------------------------------------------------ runs (runner.py)

    async def runs(self, batch_id: str) -> dict[int, Run]:
        raw = await self.redis.hgetall(self.home.batch_key(batch_id, "inflight"))
        runs = {}
        for index, value in raw.items():
            attempt, stream, entry_id = reply_text(value).split(" ")
            runs[int(index)] = Run(int(attempt), stream, entry_id)
        return runs

    async def enqueue(
        self, gateway_id: str, batch_id: str, index: int, attempt: int, request: protocol.Request, retries: int | None
    ) -> Run | None:
        """XADD the item's request, recorded as in flight in the same script; None when refused
        (the lease or the item moved on: another gateway drives the batch now). `retries`: the
        attempt this one replaces, None for the item's first."""
        stream = self.home.request_stream(request.model, request.priority)
        await self.groups.ensure(stream)
        entry_id = await self._enqueue_script(
            gateway_id, batch_id, index, stream, [attempt, request.encode(), "" if retries is None else str(retries)]
        )
        return Run(attempt, stream, reply_text(entry_id)) if entry_id else None

    async def pass_over(self, gateway_id: str, batch_id: str, index: int) -> bool:
        """Move past a new item that cannot run (its outcome is written): what `enqueue` checks, no XADD."""
        return bool(await self._enqueue_script(gateway_id, batch_id, index, "", [0, "", ""]))

    async def _enqueue_script(self, gateway_id: str, batch_id: str, index: int, stream: str, args: list[Any]) -> Any:
        batch = self.home.batch_key
        keys = [batch(batch_id), batch(batch_id, "inflight"), batch(batch_id, "lease"), stream or batch(batch_id)]
        return await self._enqueue(keys=keys, args=[gateway_id, index, *args])

    async def record(
        self, batch_id: str, index: int, outcome: dict[str, Any], attempt: int | None, owed: int = 0
    ) -> int:
        """Write the item's outcome unless one is written: 2 when this call wrote it, 1 when one was
        written already, 0 (false) when a newer attempt runs the item. The write that lands also
        records the `owed` tokens the owner's rate limit is to be charged (`owed`, `paid`): a retry
        after a lost reply answers 1, and the charge is not lost with that reply."""
        usage = outcome.get("usage") or {}
        keys = self._record_keys(batch_id)
        args = [
            index, json.dumps(outcome, separators=(",", ":")), outcome["outcome"], "" if attempt is None else str(attempt),
            usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), usage.get("cached_tokens", 0), owed,
        ]  # fmt: skip
        return int(await self._record(keys=keys, args=args))

    @staticmethod
    def owed(batch: Batch) -> dict[int, int]:
        """Item index -> the tokens its recorded outcome owes the owner's rate limit, not charged yet."""
        return {
            int(name.removeprefix(OWED)): int(value) for name, value in batch.fields.items() if name.startswith(OWED)
        }

    async def paid(self, batch_id: str, index: int) -> None:
        """The item's owed tokens are charged."""
        await self.redis.hdel(self.home.batch_key(batch_id), f"{OWED}{index}")

    async def record_many(self, batch_id: str, outcomes: list[tuple[int, dict[str, Any]]]) -> None:
        """Outcomes of items that never ran (cancelled, expired), `CHUNK` to a script call (a cluster's
        pipeline refuses scripts, so they are not pipelined)."""
        keys = self._record_keys(batch_id)
        for start in range(0, len(outcomes), CHUNK):
            args = [
                arg
                for index, outcome in outcomes[start : start + CHUNK]
                for arg in (index, json.dumps(outcome), outcome["outcome"])
            ]
            await self._record_never_ran(keys=keys, args=args)

    def _record_keys(self, batch_id: str) -> list[str]:
        return [
            self.home.batch_key(batch_id),
            self.home.batch_key(batch_id, "inflight"),
            self.home.batch_key(batch_id, "results"),
        ]

    def reply_stream(self, batch_id: str, index: int, attempt: int) -> str:
        """Where the run `attempt` of item `index` gets its events (the worker's step script writes it)."""
        return self.home.batch_reply_stream(batch_id, index, attempt)

    async def withdraw(self, run: Run, request_id: str) -> None:
        """Take a run back: deleted if no worker read it, cancelled if one runs it (as a gateway withdraws).
        Two commands, not a pipeline: a cluster's pipeline refuses PUBLISH."""
        await self.redis.xdel(run.stream, run.entry_id)
        await self.redis.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message(request_id))

    async def gone(self, runs: list[Run]) -> list[bool]:
        """For each run: its entry is neither in its stream nor pending (see GONE_LUA)."""
        if not runs:
            return []
        flags = await self._gone(
            keys=[run.stream for run in runs], args=[protocol.REQUEST_GROUP, *(run.entry_id for run in runs)]
        )
        return [bool(int(flag)) for flag in flags]

    # ------------------------------------------------------------ leases

    async def take_lease(self, batch_id: str, gateway_id: str, ms: int) -> bool:
        return await self._leases.take(self.home.batch_key(batch_id, "lease"), gateway_id, ms)

    async def renew_lease(self, batch_id: str, gateway_id: str, ms: int) -> bool:
        return await self._leases.renew(self.home.batch_key(batch_id, "lease"), gateway_id, ms)

    async def release_lease(self, batch_id: str, gateway_id: str) -> None:
        await self._leases.release(self.home.batch_key(batch_id, "lease"), gateway_id)

    # ------------------------------------------------------------ helpers

    async def _page(self, index: str, after: str | None, before: str | None, limit: int) -> tuple[list[str], bool]:
        """Ids newest first: after `after` (older than it), or before `before` (newer than it)."""
        if before:
            rank = await self.redis.zrevrank(index, before)
            if rank is None:
                return [], False
            start = max(0, rank - limit)
            ids = await self.redis.zrevrange(index, start, rank - 1)
            return [reply_text(i) for i in ids], start > 0
        start = 0
        if after:
            rank = await self.redis.zrevrank(index, after)
            if rank is None:
                return [], False
            start = rank + 1
        ids = await self.redis.zrevrange(index, start, start + limit)
        return [reply_text(i) for i in ids[:limit]], len(ids) > limit


def _pairs(mapping: dict[str, str]) -> list[str]:
    """A hash's fields as HSET's arguments: field, value, field, value, ..."""
    return [part for item in mapping.items() for part in item]
