"""Each API key's fair share of the request queue: at most `max_queue_per_key` of its entries wait at once.

The request streams are shared by every key (`max_queue` per model stream), so without a share one
key can fill them: one request enqueues up to 64 entries (`n` × prompts), and a key limited to 5
requests a minute could make every other tenant wait until its pickup timeout. With API keys set,
each entry a key enqueues is claimed in its share before the XADD and released when a worker
picks it up (its first event) or the gateway withdraws it; a key whose share is full gets a 429
with Retry-After in its API's shape (OpenAI `rate_limit_exceeded`, Anthropic `rate_limit_error`),
and other keys' entries still go in.

A background response's entry takes a place too (gateway/responses/background.py), claimed for the
key that owns it (`claim_owner`: by the key's digest, as batch items are admitted by it) before its
XADD. A full share does not refuse it: it waits, queued, and its driver claims again each tick, as a
batch item waits for its key's budget. Its entry may wait longer than a pickup timeout (until its
deadline), so its driver renews the claim (`hold_owner`) until a worker picks it up.

The share is counted in Redis, so every gateway sees one count: a sorted set per key
(`lmq:ratelimit:{<digest>}:queued`) of the entries' request ids, scored with when the claim
expires. One Lua script prunes expired claims, counts and claims, so two gateways cannot both take
the last place. A claim expires after `pickup_timeout` (by then its request has been picked up or
has failed with 504), so a gateway that dies holding claims leaks nothing past that.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar

import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.typedefs import Handler
from redis.exceptions import RedisError

from protocol.keys import rate_limit_key

from .auth import presented_key
from .errors import ApiError
from .rate_limits import _digest  # one digest names every per-key counter

log = logging.getLogger(__name__)

# KEYS = [the key's sorted set]; ARGV = [request id, now ms, claim ms, share].  Answers the entries
# waiting before this claim, or -1 when the share was full (nothing claimed).
CLAIM_LUA = r"""
local now, ttl, share = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local waiting = redis.call('ZCARD', KEYS[1])
if waiting >= share then return -1 end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl)
return waiting
"""

# KEYS = [the key's sorted set]; ARGV = [request id, now ms, claim ms]: a claim still held expires later
# (a released one is not claimed again).
HOLD_LUA = r"""
if redis.call('ZADD', KEYS[1], 'XX', 'CH', tonumber(ARGV[2]) + tonumber(ARGV[3]), ARGV[1]) == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 0
"""

_key: ContextVar[str | None] = ContextVar("lmq_queue_share_key", default=None)


class QueueShare:
    def __init__(self, redis: aioredis.Redis, share: int, claim_seconds: float, retry_after: int):
        self.redis = redis
        self.share = share
        self.claim_ms = max(1000, int(claim_seconds * 1000))
        self.retry_after = retry_after
        self._claim = redis.register_script(CLAIM_LUA)
        self._hold = redis.register_script(HOLD_LUA)

    async def claim(self, request_id: str) -> str | None:
        """Claim a place for one entry of the current API key; returns the set to release it from
        (None when no key or no share applies). A full share raises a 429 ApiError."""
        key = _key.get()
        if key is None or self.share <= 0:
            return None
        name = rate_limit_key(_digest(key), "queued")
        if not await self._claimed(name, request_id):
            raise ApiError(
                429,
                f"this API key has {self.share} requests waiting in the queue, its share; retry when some have started",
                code="rate_limit_exceeded",
                retry_after=self.retry_after,
            )
        return name

    async def _claimed(self, name: str, request_id: str) -> bool:
        waiting = await self._claim(keys=[name], args=[request_id, int(time.time() * 1000), self.claim_ms, self.share])
        return int(waiting) >= 0

    async def release(self, name: str | None, request_id: str) -> None:
        if name is None:
            return
        try:
            await self.redis.zrem(name, request_id)
        except RedisError as exc:  # the claim expires by itself
            log.warning("could not release %s's place in its key's queue share: %s", request_id, exc)

    # Background responses: owned by a key's digest (gateway/auth.py's key_digest), no key presented.

    async def claim_owner(self, owner: str, request_id: str) -> bool:
        """Claim a place for an entry of the key whose digest is `owner`; False while its share is full."""
        return not owner or self.share <= 0 or await self._claimed(rate_limit_key(owner, "queued"), request_id)

    async def hold_owner(self, owner: str, request_id: str) -> None:
        """The claim of an entry still waiting expires a claim's time from now."""
        if owner and self.share > 0:
            args = [request_id, int(time.time() * 1000), self.claim_ms]
            await self._hold(keys=[rate_limit_key(owner, "queued")], args=args)

    async def release_owner(self, owner: str, request_id: str) -> None:
        if owner:
            await self.release(rate_limit_key(owner, "queued"), request_id)


def setup_queue_share(app: web.Application) -> None:
    """Name the presented API key for the request's queue claims (auth has checked it by then)."""
    app.middlewares.append(_middleware)


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    token = _key.set(presented_key(request))
    try:
        return await handler(request)
    finally:
        _key.reset(token)
