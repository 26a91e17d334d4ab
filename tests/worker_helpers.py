"""Shared by the worker tests: a tiny model, in-process workers, requests and their reply streams."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

import redis.asyncio as aioredis

import protocol
from worker.config import WorkerConfig
from worker.service import Worker

MODEL = "tiny"
STREAM = protocol.request_stream(MODEL)


def worker_config(redis_url: str, worker_id: str, **overrides) -> WorkerConfig:
    settings = dict(redis_url=redis_url, model_name=MODEL, worker_id=worker_id, kv_memory="4MiB", max_seqs=4, claim_idle_ms=600, grace_seconds=30.0)
    settings.update(overrides)
    return WorkerConfig(**settings)


@contextlib.asynccontextmanager
async def running_worker(config: WorkerConfig, model) -> AsyncIterator[Worker]:
    """A worker in this event loop, live (heartbeat written) on entry, drained on exit."""
    redis = aioredis.Redis.from_url(config.redis_url)
    worker = Worker(config, model, redis)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_for(lambda: redis.exists(protocol.worker_key(config.worker_id)), what="the worker's heartbeat")
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await redis.aclose()


async def wait_for(check, *, what: str, timeout: float = 30.0):
    """Poll an async check until it returns something true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await check()
        if result:
            return result
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def chat_request(request_id: str, *, max_tokens: int = 8, deadline_s: float = 60.0, **fields) -> protocol.Request:
    """A greedy request whose events go to the reply stream `out:<id>`; `ignore_eos` keeps it to max_tokens."""
    inputs = fields or {"prompt": "The quick brown fox"}
    return protocol.Request(
        id=request_id,
        model=MODEL,
        reply=protocol.Reply("stream", f"out:{request_id}"),
        sampling=protocol.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        deadline=time.time() + deadline_s,
        **inputs,
    )


async def enqueue(redis: aioredis.Redis, request: protocol.Request) -> str:
    return (await redis.xadd(STREAM, {"msg": request.encode()})).decode()


async def reply_events(redis: aioredis.Redis, reply_key: str) -> list[dict]:
    return [protocol.decode_event(fields[b"msg"]) for _, fields in await redis.xrange(reply_key)]


async def final_events(redis: aioredis.Redis, reply_key: str, timeout: float = 30.0) -> list[dict]:
    """All events of a request once its last one (done or error) arrived."""

    async def ended():
        events = await reply_events(redis, reply_key)
        return events if events and events[-1]["type"] != "delta" else None

    return await wait_for(ended, what=f"the end of {reply_key}", timeout=timeout)


def streamed_tokens(events: list[dict]) -> list[int]:
    """The token ids a client relays: deltas in order, any delta below the relayed count dropped."""
    tokens: list[int] = []
    for event in events:
        if event["type"] == "delta" and event["offset"] >= len(tokens):
            assert event["offset"] == len(tokens), "a gap in the streamed tokens"
            tokens += event["token_ids"]
    return tokens
