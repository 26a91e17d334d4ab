"""A worker's liveness key: `SET lmq:worker:<id> <Heartbeat> EX 10` every 2 s, deleted on stop (in the home shard on a cluster)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from protocol import Heartbeat
from protocol.keys import UNSHARDED, Shard
from protocol.redis_client import REDIS_FAILURES

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TTL_S = 10


async def heartbeat_loop(
    redis: aioredis.Redis, worker_id: str, current: Callable[[], Heartbeat], home: Shard = UNSHARDED
) -> None:
    """Refresh the key until cancelled, then delete it so gateways stop listing this worker at once."""
    key = home.worker_key(worker_id)
    try:
        while True:
            try:
                await redis.set(key, current().encode(), ex=HEARTBEAT_TTL_S)
            except REDIS_FAILURES as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
    finally:
        await asyncio.shield(redis.delete(key))
