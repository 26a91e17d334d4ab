"""The Redis client lmq's processes use: a bounded pool that waits for a free connection, and
reconnects a command whose pooled connection died.

redis-py's default pool raises "Too many connections" once 100 commands are in flight, which a
gateway with a few hundred open requests reaches; waiting a moment for a connection is right.
After a Redis restart every pooled connection is dead: without a retry, each one would fail the
one request that next picks it up.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError

MAX_CONNECTIONS = 100
CONNECTION_WAIT_S = 10.0
RETRIES = 3  # per command: backoff 0.05, 0.1, 0.2 s, enough to get past a dead pooled connection


def connect(url: str) -> aioredis.Redis:
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=CONNECTION_WAIT_S,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), RETRIES),
        retry_on_error=[ConnectionError, TimeoutError],
    )
    return aioredis.Redis(connection_pool=pool)
