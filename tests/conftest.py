"""Shared fixtures: a real Redis server for the whole session, a clean database per test, and the
tiny random-weight model that most tests run."""

from __future__ import annotations

import pathlib

import pytest
import redis.asyncio as aioredis

from lmq.redis_server import EmbeddedRedis
from tiny_model import make_tiny_model
from worker.model.loader import LoadedModel, load_model


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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An HF-style directory of a tiny Llama model with random weights (tests/tiny_model.py)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny(tiny_model_dir: pathlib.Path) -> LoadedModel:
    """The tiny model, loaded in float32."""
    return load_model(str(tiny_model_dir), dtype="float32", quant="none", device="cpu")
