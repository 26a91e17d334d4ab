"""Helpers for gateway tests: a gateway on a real port, and a scripted stand-in for a worker.

The scripted worker speaks the real protocol over the real Redis (reads the request stream in the
`workers` group, publishes event batches to the request's reply channel, acks and deletes), but its
"model" is a function from the request to the event batches it answers with.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis.asyncio as aioredis
from aiohttp.test_utils import TestServer
from redis.exceptions import ResponseError

import protocol
from gateway.app import create_app
from gateway.config import GatewayConfig
from protocol.cluster_url import shard_layout
from protocol.redis_client import connect
from tests.support.worker_harness import stop_worker, wait_for
from worker.config import WorkerConfig
from worker.service import Worker

MODEL = "tiny-test"  # the name scripted workers answer to
REAL_MODEL = "tiny"  # the name real workers on the tiny model serve
Script = Callable[[protocol.Request], list[list[dict[str, Any]]]]


@contextlib.asynccontextmanager
async def running_gateway(redis_url: str, **settings: Any) -> AsyncIterator[str]:
    """A gateway serving on a free local port; yields its base URL (http://127.0.0.1:PORT)."""
    config = GatewayConfig(redis_url=redis_url, **settings)
    server = TestServer(create_app(config), handler_cancellation=True)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def heartbeat(model: str = MODEL, worker_id: str = "scripted") -> protocol.Heartbeat:
    return protocol.Heartbeat(
        worker_id=worker_id,
        model=model,
        capacity=4,
        running=0,
        waiting=0,
        kv_pages_used=0,
        kv_pages_total=64,
        time=time.time(),
    )


async def announce(redis: aioredis.Redis, model: str = MODEL, worker_id: str = "scripted") -> None:
    """Make gateways believe a worker serves `model` (a heartbeat key, as workers write it)."""
    await redis.set(protocol.worker_key(worker_id), heartbeat(model, worker_id).encode(), ex=60)


def words_script(
    words: list[str], finish_reason: str = "stop", prompt_tokens: int = 7, cached_tokens: int = 0
) -> Script:
    """Answer every request with one delta per word, then `done`."""

    def script(request: protocol.Request) -> list[list[dict[str, Any]]]:
        batches = [[protocol.delta_event(request.id, i, word, [100 + i], i)] for i, word in enumerate(words)]
        done = protocol.done_event(request.id, len(words), finish_reason, prompt_tokens, len(words), cached_tokens)
        return batches + [[done]]

    return script


async def take_request(
    redis: aioredis.Redis, model: str = MODEL, consumer: str = "scripted", stop: asyncio.Event | None = None
) -> tuple[str, protocol.Request] | None:
    """Wait until a request is in the model's stream and read it as a worker would (None once `stop` is set)."""
    stream = protocol.request_stream(model)
    with contextlib.suppress(ResponseError):
        await redis.xgroup_create(stream, protocol.REQUEST_GROUP, id="0", mkstream=True)
    while stop is None or not stop.is_set():
        entries = await redis.xreadgroup(protocol.REQUEST_GROUP, consumer, {stream: ">"}, count=1, block=100)
        if entries:
            entry_id, fields = entries[0][1][0]
            return entry_id.decode(), protocol.decode_request(fields[b"msg"])
    return None


async def publish(redis: aioredis.Redis, request: protocol.Request, events: list[dict[str, Any]]) -> None:
    await redis.publish(request.reply.key, protocol.encode_event_batch(events))


async def finish(redis: aioredis.Redis, request: protocol.Request, entry_id: str) -> None:
    stream = protocol.request_stream(request.model)
    await redis.xack(stream, protocol.REQUEST_GROUP, entry_id)
    await redis.xdel(stream, entry_id)


async def scripted_worker(
    redis: aioredis.Redis,
    script: Script,
    received: list[protocol.Request],
    model: str,
    worker_id: str,
    stop: asyncio.Event,
) -> None:
    """Serve requests with `script` until `stop` is set, appending each request to `received`.

    (A stop event, not task cancellation: redis-py may swallow a cancellation during a blocking read.)
    """
    while taken := await take_request(redis, model, worker_id, stop):
        entry_id, request = taken
        received.append(request)
        for batch in script(request):
            await publish(redis, request, batch)
        await finish(redis, request, entry_id)


@contextlib.asynccontextmanager
async def worker_running(
    redis: aioredis.Redis, script: Script, model: str = MODEL, worker_id: str = "scripted"
) -> AsyncIterator[list[protocol.Request]]:
    """A scripted worker for the block; yields the list of requests it received."""
    received: list[protocol.Request] = []
    stop = asyncio.Event()
    task = asyncio.create_task(scripted_worker(redis, script, received, model, worker_id, stop))
    await announce(redis, model, worker_id)
    try:
        yield received
    finally:
        stop.set()
        await task


@contextlib.asynccontextmanager
async def real_worker(redis_url: str, model: Any, worker_id: str = "w1", **settings: Any) -> AsyncIterator[Worker]:
    """A real worker (engine and all) on `model` in this event loop, serving REAL_MODEL; live on entry.
    `redis_url` any of lmq's URLs (a cluster's too: its heartbeat is looked for in the home shard)."""
    config = WorkerConfig(
        **{
            "redis_url": redis_url,
            "model_name": REAL_MODEL,
            "worker_id": worker_id,
            "kv_memory": "4MiB",
            "max_seqs": 4,
            **settings,
        }
    )
    redis = connect(redis_url)
    worker = Worker(config, model, redis)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))

    async def live() -> bool:
        if task.done():
            task.result()  # the worker failed to start: raise its error
        return bool(await redis.exists(shard_layout(redis_url).home.worker_key(worker_id)))

    try:
        await wait_for(live, what=f"worker {worker_id}'s heartbeat")
        yield worker
    finally:
        try:
            await stop_worker(task, stop, config.grace_seconds)
        finally:
            await redis.aclose()
