"""Stored responses in Redis: what GET, DELETE, cancel, previous_response_id and the background runner read.

Keys (spelled with the home shard, protocol/keys.py; on a Redis Cluster all carry its hash tag, so
a script may touch them and the home shard's request stream together):

    lmq:response:<id>           hash    owner, status, the response object (JSON), the conversation
                                        so far (JSON), and for a background response: its protocol
                                        request, its entry in the request stream, what rebuilds it
    lmq:response:<id>:events    stream  a background response's stream events, entry id 0-<seq + 1>
    lmq:response:<id>:lease     string  the gateway driving a background response (SET NX PX)
    lmq:reply:response:<id>     stream  the worker's events for a background response (a reply form
                                        workers accept: docs/protocol.md)
    lmq:responses-active        set     background responses not ended: what gateways look for work in

A response belongs to the API key that made it (gateway/auth.py's digest, "" on a gateway without
keys): `get` answers None to anyone else, so another key gets the handlers' 404. Ids are checked
against the shape `new_id` makes before they name a key. Every key expires `ttl` seconds after the
response was stored or ended. Enqueueing a background response and cancelling it are one script
each, so two gateways never enqueue one response twice.

Every write that must land whole is one Lua script, never a MULTI: a record with its place in the
active set, a background response's end (its record, the expiry of its events, its reply stream
deleted, out of the active set), a deletion.

A DELETE wins over the driver of a background response: the driver may have checked the record
just before it, and then writes what the worker's next event changes. Every write of a driver (the
record's in-progress object: `update`; its stream events: `append`; its end: `end`) is a script
that checks the record exists and writes only then, so none makes the response again after its
deletion (an ownerless record nobody can read, an event stream that nothing would expire). On a cluster a MULTI's EXEC goes where the client's slot
map said at its last refresh, and a failover or a slot move in between fails the transaction; a
script is one command, which a cluster client retries at the node that now serves the slot.

Why every response shares the home shard's one slot, rather than a hash tag of its own: a script on
a cluster touches one slot, and what must change together spans responses. The enqueue script
XADDs to the home shard's request stream (the shard whose workers read it) as it marks the record;
the worker's step script writes the reply stream in the step that acknowledges that entry, so the
reply stream must be in the request stream's slot (`Shard.holds`); and the active set, which every
gateway scans for work, is one key that `save` and `end` change with a record. A tag per response
would spread the records over the primaries, but splits each of those writes in two with a window
between them (an ended response still active, an active id with no record) that a recovery rule
would have to close. The home slot's load is a few writes a response, plus a background
response's events: small beside the request path, which is sharded. The key names and fields are
those of the MULTI version, so records stored before this change read unchanged.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

import redis.asyncio as aioredis

from protocol.keys import Shard
from protocol.redis_client import reply_text

from ..leased_drivers import LeaseKeys

ID = re.compile(r"resp_[0-9a-f]{32}")
ENDED = ("completed", "incomplete", "failed", "cancelled")

ENQUEUE_LUA = r"""
-- KEYS = [response, request stream]: a queued background response not yet in the queue goes in once
if redis.call('HGET', KEYS[1], 'state') ~= 'running' or redis.call('HEXISTS', KEYS[1], 'entry') == 1
   or redis.call('HEXISTS', KEYS[1], 'cancel') == 1 then
  return false
end
local entry = redis.call('XADD', KEYS[2], '*', 'msg', redis.call('HGET', KEYS[1], 'msg'))
redis.call('HSET', KEYS[1], 'entry', KEYS[2] .. ' ' .. entry)
return entry
"""

CANCEL_LUA = r"""
-- KEYS = [response]: a running background response is flagged for its driver; answers its status after
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
  return 'cancelled'
end
return state
"""


SAVE_LUA = r"""
-- KEYS = [response, active set]; ARGV = [response id, ttl s, "1" if active else "", field, value, ...]
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[2])
if ARGV[3] == '1' then redis.call('SADD', KEYS[2], ARGV[1]) end
return 1
"""

UPDATE_LUA = r"""
-- KEYS = [response]; ARGV = [ttl s, field, value, ...]: 0 (nothing written) if it was deleted
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

APPEND_LUA = r"""
-- KEYS = [response, events]; ARGV = [entry id, event JSON, ...]: nothing if the response was deleted;
-- an event already written (an id not above the stream's last) is skipped
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 1, #ARGV, 2 do
  local added = redis.pcall('XADD', KEYS[2], ARGV[i], 'e', ARGV[i + 1])
  if type(added) == 'table' and added.err and not string.find(added.err, 'equal or smaller', 1, true) then
    return redis.error_reply(added.err)
  end
end
return 1
"""

END_LUA = r"""
-- KEYS = [response, events, reply stream, active set]; ARGV = [response id, ttl s, field, value, ...]
-- a background response's last write; 0 (only off the active set) if it was deleted meanwhile
redis.call('SREM', KEYS[4], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('DEL', KEYS[3])
return 1
"""

DELETE_LUA = r"""
-- KEYS = [response, events, reply stream, active set]; ARGV = [response id]
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('SREM', KEYS[4], ARGV[1])
return 1
"""


def new_id() -> str:
    return f"resp_{secrets.token_hex(16)}"


class ResponseStore:
    def __init__(self, redis: aioredis.Redis, home: Shard, ttl: int):
        self.redis = redis
        self.home = home
        self.ttl = ttl
        self._enqueue = redis.register_script(ENQUEUE_LUA)
        self._cancel = redis.register_script(CANCEL_LUA)
        self._leases = LeaseKeys(redis)
        self._save = redis.register_script(SAVE_LUA)
        self._update = redis.register_script(UPDATE_LUA)
        self._append = redis.register_script(APPEND_LUA)
        self._end = redis.register_script(END_LUA)
        self._delete = redis.register_script(DELETE_LUA)

    def key(self, response_id: str, part: str = "") -> str:
        return self.home.key(f"response:{response_id}" + (f":{part}" if part else ""))

    def reply_stream(self, response_id: str) -> str:
        return self.home.key(f"reply:response:{response_id}")

    @property
    def active_key(self) -> str:
        return self.home.key("responses-active")

    # ------------------------------------------------------------ records

    async def get(self, response_id: str, owner: str) -> dict[str, str] | None:
        """The record if `owner` owns it; None for a malformed id, a missing record, or another owner's."""
        if not ID.fullmatch(response_id):
            return None
        record = await self.record(response_id)
        return record if record and record.get("owner") == owner else None

    async def record(self, response_id: str) -> dict[str, str] | None:
        """The record, whoever owns it (for the runner)."""
        raw = await self.redis.hgetall(self.key(response_id))
        return {
            reply_text(k): reply_text(v) for k, v in raw.items() if k != b"msg"
        } or None  # msg: msgpack, for the script

    async def forget(self, response_id: str) -> None:
        """No gateway need drive it (it ended, or was deleted)."""
        await self.redis.srem(self.active_key, response_id)

    async def save(self, response_id: str, fields: dict[str, Any], active: bool = False) -> None:
        """Write a new record (the POST's); it expires `ttl` seconds from now. `active`: a background
        response some gateway must drive."""
        keys = [self.key(response_id), self.active_key]
        await self._save(keys=keys, args=[response_id, self.ttl, "1" if active else "", *_pairs(fields)])

    async def update(self, response_id: str, fields: dict[str, Any]) -> bool:
        """Add to a record that still exists (a driver's write); it expires `ttl` seconds from now.
        False, and nothing written, if it was deleted."""
        return bool(await self._update(keys=[self.key(response_id)], args=[self.ttl, *_pairs(fields)]))

    async def end(self, response_id: str, fields: dict[str, Any]) -> None:
        """A background response's last write: its final object; it leaves the active set, and every
        key of it expires `ttl` from now (the worker's reply stream is deleted). A response deleted
        meanwhile only leaves the active set: no record is made again without its owner."""
        await self._end(keys=self._keys(response_id), args=[response_id, self.ttl, *_pairs(fields)])

    async def delete(self, response_id: str) -> None:
        await self._delete(keys=self._keys(response_id), args=[response_id])

    def _keys(self, response_id: str) -> list[str]:
        """A response's keys, and the active set."""
        return [self.key(response_id), self.key(response_id, "events"), self.reply_stream(response_id), self.active_key]

    async def enqueue(self, response_id: str, stream: str) -> str | None:
        """XADD a queued background response's request, once whoever asks; its entry id, or None."""
        entry = await self._enqueue(keys=[self.key(response_id), stream])
        return reply_text(entry) or None

    async def cancel(self, response_id: str) -> str:
        return reply_text(await self._cancel(keys=[self.key(response_id)]))

    # ------------------------------------------------------------ a background response's events

    async def append(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """Each event as entry 0-<seq + 1>, while the response exists: an event already written (by a
        gateway that drove the response before) is refused by Redis as an id not above the last, and
        skipped."""
        args: list[str] = []
        for event in events:
            args += [f"0-{event['sequence_number'] + 1}", json.dumps(event, separators=(",", ":"))]
        if args:
            await self._append(keys=[self.key(response_id), self.key(response_id, "events")], args=args)

    async def written(self, response_id: str) -> int:
        """How many events are written (the next sequence number)."""
        last = await self.redis.xrevrange(self.key(response_id, "events"), count=1)
        return int(reply_text(last[0][0]).split("-")[1]) if last else 0

    async def events(self, response_id: str, after: int, block_ms: int) -> list[dict[str, Any]]:
        """The events after sequence number `after`, waiting up to `block_ms` for one."""
        key = self.key(response_id, "events")
        reply = await self.redis.xread({key: f"0-{after + 1}"}, count=256, block=block_ms)
        return [json.loads(fields[b"e"]) for _, entries in reply or [] for _, fields in entries]

    # ------------------------------------------------------------ driving background responses

    async def active(self) -> list[str]:
        return sorted(reply_text(member) for member in await self.redis.smembers(self.active_key))

    async def take_lease(self, response_id: str, gateway_id: str, ms: int) -> bool:
        return await self._leases.take(self.key(response_id, "lease"), gateway_id, ms)

    async def renew_lease(self, response_id: str, gateway_id: str, ms: int) -> bool:
        return await self._leases.renew(self.key(response_id, "lease"), gateway_id, ms)

    async def release_lease(self, response_id: str, gateway_id: str) -> None:
        await self._leases.release(self.key(response_id, "lease"), gateway_id)


def _pairs(fields: dict[str, Any]) -> list[str | bytes]:
    """A hash's fields as HSET's arguments: field, value, field, value, ..."""
    return [part for name, value in fields.items() for part in (name, _field(value))]


def _field(value: Any) -> str | bytes:
    if isinstance(value, (str, bytes)):
        return value
    return json.dumps(value, separators=(",", ":"))
