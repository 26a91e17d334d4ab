"""Shared by the worker tests: a tiny model, in-process workers, requests and their reply streams."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

import protocol
from worker.config import WorkerConfig
from worker.service import Worker

MODEL = "tiny"
STREAM = protocol.request_stream(MODEL)
# How long a test waits for something that takes milliseconds on an idle machine. Generous: on two
# cores shared with other work, a step of the tiny model can take a second and a process start a
# minute; a deadline only turns a hang into a clear failure, so it is never what a test measures.
TIMEOUT_S = 120.0


def worker_config(redis_url: str, worker_id: str, **overrides) -> WorkerConfig:
    settings = dict(
        redis_url=redis_url,
        model_name=MODEL,
        worker_id=worker_id,
        kv_memory="4MiB",
        max_seqs=4,
        claim_idle_ms=600,
        grace_seconds=30.0,
    )
    settings.update(overrides)
    return WorkerConfig(**settings)


@contextlib.asynccontextmanager
async def running_worker(config: WorkerConfig, model) -> AsyncIterator[Worker]:
    """A worker in this event loop, live (heartbeat written) on entry, drained on exit."""
    redis = aioredis.Redis.from_url(config.redis_url)
    worker = Worker(config, model, redis)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))

    async def live() -> bool:
        if task.done():
            task.result()  # the worker failed to start: raise its error
        return bool(await redis.exists(protocol.worker_key(config.worker_id)))

    try:
        await wait_for(live, what="the worker's heartbeat")
        yield worker
    finally:
        try:
            await stop_worker(task, stop, config.grace_seconds)
        finally:
            await redis.aclose()


async def stop_worker(task: asyncio.Task, stop: asyncio.Event, grace_seconds: float) -> None:
    """Set the worker's stop event and wait for `Worker.run` to return: within the grace time it has
    for running requests, plus TIMEOUT_S. A worker that does not stop fails the test (with the tasks
    still running), rather than hanging it."""
    stop.set()
    timeout = grace_seconds + TIMEOUT_S
    done, _ = await asyncio.wait([task], timeout=timeout)
    if not done:
        running = [t for t in asyncio.all_tasks() if not t.done() and t is not asyncio.current_task()]
        where = "\n".join(f"  {t.get_name()}: {_top_frame(t)}" for t in running)
        task.cancel()
        raise AssertionError(
            f"the worker did not stop within {timeout:.0f} s of its stop event; tasks still running:\n{where}"
        )
    task.result()


def _top_frame(task: asyncio.Task) -> str:
    stack = task.get_stack()
    if not stack:
        return "?"
    frame = stack[-1]
    return f"{frame.f_code.co_name} at {frame.f_code.co_filename}:{frame.f_lineno}"


async def wait_for(check, *, what: str, timeout: float = TIMEOUT_S):
    """Poll an async check until it returns something true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await check()
        if result:
            return result
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def chat_request(request_id: str, *, max_tokens: int = 8, deadline_s: float = 600.0, **fields) -> protocol.Request:
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


async def final_events(redis: aioredis.Redis, reply_key: str, timeout: float = TIMEOUT_S) -> list[dict]:
    """All events of a request once its last one (done or error) arrived."""

    async def ended():
        events = await reply_events(redis, reply_key)
        return events if events and events[-1]["type"] in ("done", "error") else None

    return await wait_for(ended, what=f"the end of {reply_key}", timeout=timeout)


def streamed_tokens(events: list[dict]) -> list[int]:
    """The token ids a client relays: deltas in order, any delta below the relayed count dropped."""
    tokens: list[int] = []
    for event in events:
        if event["type"] == "delta" and event["offset"] >= len(tokens):
            assert event["offset"] == len(tokens), "a gap in the streamed tokens"
            tokens += event["token_ids"]
    return tokens
