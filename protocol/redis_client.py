"""The Redis client lmq's processes use: a bounded pool that waits for a free connection.

redis-py's default pool raises "Too many connections" once 100 commands are in flight, which a
gateway with a few hundred open requests reaches; waiting a moment for a connection is right.
"""

from __future__ import annotations

import redis.asyncio as aioredis

MAX_CONNECTIONS = 100
CONNECTION_WAIT_S = 10.0


def connect(url: str) -> aioredis.Redis:
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=MAX_CONNECTIONS, timeout=CONNECTION_WAIT_S)
    return aioredis.Redis(connection_pool=pool)
