"""The models live workers serve, read from their heartbeat keys."""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

import protocol
from protocol.keys import UNSHARDED, Shard

from .errors import ApiError

log = logging.getLogger(__name__)

CACHE_SECONDS = 1.0
RETRY_AFTER_NO_WORKER_S = 5


class ModelRegistry:
    def __init__(self, redis: aioredis.Redis, home: Shard = UNSHARDED):
        self.redis = redis
        self.home = home  # where heartbeats live
        self._served: set[str] = set()
        self._read_at = float("-inf")
        self._malformed: set[bytes] = set()  # heartbeat keys already logged as malformed (logged once each)
        self._reading: asyncio.Lock = asyncio.Lock()

    async def heartbeats(self) -> list[protocol.Heartbeat]:
        keys = [key async for key in self.redis.scan_iter(match=f"{self.home.worker_key_prefix}*", count=1000)]
        values = await self.redis.mget(keys) if keys else []
        beats = []
        for key, raw in zip(keys, values):
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                beats.append(protocol.Heartbeat.decode(raw))
            except protocol.ProtocolError as exc:  # skipped, not fatal: any one key must not fail every request
                if key not in self._malformed:
                    log.warning("ignored a malformed heartbeat in %s: %s", key, exc)
                self._malformed.add(key)
        return beats

    async def served(self, *, fresh: bool = False) -> set[str]:
        """The models at least one live worker serves (re-read at most once a second unless `fresh`)."""
        asked_at = time.monotonic()
        if fresh or asked_at - self._read_at > CACHE_SECONDS:
            async with self._reading:  # one read at a time: callers that waited share the one just made
                if self._read_at < asked_at if fresh else asked_at - self._read_at > CACHE_SECONDS:
                    read_at = time.monotonic()
                    self._served = {beat.model for beat in await self.heartbeats()}
                    self._read_at = read_at
        return self._served

    async def require(self, model: str) -> str:
        """`model` itself when a live worker serves it. A model served before (its request stream exists)
        whose workers are all gone is a 503 with Retry-After, which clients retry (workers restart); one
        never served is a 404."""
        if model in await self.served() or model in await self.served(fresh=True):
            return model
        if await self.redis.exists(self.home.request_stream(model)):
            raise ApiError(
                503,
                f"no worker serves {model!r} right now; retry shortly",
                code="no_worker",
                retry_after=RETRY_AFTER_NO_WORKER_S,
            )
        served = ", ".join(sorted(self._served)) or "none"
        raise ApiError(
            404,
            f"the model {model!r} does not exist or no worker serves it (served: {served})",
            param="model",
            code="model_not_found",
        )
