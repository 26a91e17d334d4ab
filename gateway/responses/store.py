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
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol.keys import Shard
from protocol.redis_client import reply_text, transaction

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

RENEW_LUA = r"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

RELEASE_LUA = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
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
        self._renew = redis.register_script(RENEW_LUA)
        self._release = redis.register_script(RELEASE_LUA)

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
        """Write (or add to) a record; it expires `ttl` seconds from now. `active`: a background
        response some gateway must drive."""
        pipe = await transaction(self.redis)
        pipe.hset(self.key(response_id), mapping={name: _field(value) for name, value in fields.items()})
        pipe.expire(self.key(response_id), self.ttl)
        if active:
            pipe.sadd(self.active_key, response_id)
        await pipe.execute()

    async def end(self, response_id: str, fields: dict[str, Any]) -> None:
        """A background response's last write: its final object; it leaves the active set, and every
        key of it expires `ttl` from now (the worker's reply stream is deleted)."""
        if not await self.redis.exists(self.key(response_id)):
            await self.redis.srem(self.active_key, response_id)  # deleted meanwhile
            return
        pipe = await transaction(self.redis)
        pipe.hset(self.key(response_id), mapping={name: _field(value) for name, value in fields.items()})
        pipe.expire(self.key(response_id), self.ttl)
        pipe.expire(self.key(response_id, "events"), self.ttl)
        pipe.delete(self.reply_stream(response_id))
        pipe.srem(self.active_key, response_id)
        await pipe.execute()

    async def delete(self, response_id: str) -> None:
        pipe = await transaction(self.redis)
        pipe.delete(self.key(response_id), self.key(response_id, "events"), self.reply_stream(response_id))
        pipe.srem(self.active_key, response_id)
        await pipe.execute()

    async def enqueue(self, response_id: str, stream: str) -> str | None:
        """XADD a queued background response's request, once whoever asks; its entry id, or None."""
        entry = await self._enqueue(keys=[self.key(response_id), stream])
        return reply_text(entry) or None

    async def cancel(self, response_id: str) -> str:
        return reply_text(await self._cancel(keys=[self.key(response_id)]))

    # ------------------------------------------------------------ a background response's events

    async def append(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """Each event as entry 0-<seq + 1>: an event already written (by a gateway that drove the
        response before) is refused by Redis as an id not above the last, and skipped."""
        key = self.key(response_id, "events")
        for event in events:
            try:
                await self.redis.xadd(
                    key, {"e": json.dumps(event, separators=(",", ":"))}, id=f"0-{event['sequence_number'] + 1}"
                )
            except ResponseError as exc:
                if "equal or smaller" not in str(exc):
                    raise

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
        return bool(await self.redis.set(self.key(response_id, "lease"), gateway_id, nx=True, px=ms))

    async def renew_lease(self, response_id: str, gateway_id: str, ms: int) -> bool:
        return bool(await self._renew(keys=[self.key(response_id, "lease")], args=[gateway_id, ms]))

    async def release_lease(self, response_id: str, gateway_id: str) -> None:
        await self._release(keys=[self.key(response_id, "lease")], args=[gateway_id])


def _field(value: Any) -> str | bytes:
    if isinstance(value, (str, bytes)):
        return value
    return json.dumps(value, separators=(",", ":"))
