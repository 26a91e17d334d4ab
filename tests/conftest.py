"""Shared fixtures: a real Redis server for the whole session, and a clean database per test."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from lmq.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
async def redis_url(redis_server: EmbeddedRedis) -> str:
    """The URL of the session's Redis, emptied before each test."""
    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushall()
    await client.aclose()
    return redis_server.url


@pytest.fixture
async def redis_client(redis_url: str):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()
