"""Priorities through a real worker (in process, the tiny model, real Redis): interactive requests are
read and run while batch work fills the worker, and the queue's guarantees hold on both streams."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

import protocol
from protocol import REQUEST_GROUP
from tests.support.batch_files import slow
from tests.support.worker_harness import (
    MODEL,
    chat_request,
    reply_events,
    running_worker,
    streamed_tokens,
    wait_for,
    worker_config,
)
from worker.claims import RequestStream
from worker.service import READ_BLOCK_MS

BATCH_STREAM = protocol.request_stream(MODEL, "batch")
INTERACTIVE_STREAM = protocol.request_stream(MODEL)


def batch_request(request_id: str, max_tokens: int) -> protocol.Request:
    return dataclasses.replace(chat_request(request_id, max_tokens=max_tokens), priority="batch")


async def put(redis, request: protocol.Request, entry_id: str = "*") -> str:
    stream = protocol.request_stream(request.model, request.priority)
    return (await redis.xadd(stream, {"msg": request.encode()}, id=entry_id)).decode()


async def end_of(redis, request_id: str) -> dict | None:
    events = await reply_events(redis, f"out:{request_id}")
    return next((event for event in events if event["type"] in ("done", "error")), None)


async def all_acknowledged(redis) -> bool:
    for stream in (INTERACTIVE_STREAM, BATCH_STREAM):
        if await redis.xlen(stream) or (await redis.xpending(stream, REQUEST_GROUP))["pending"]:
            return False
    return True


@pytest.mark.slow  # four 150-token answers on slowed steps: seconds
async def test_an_interactive_request_overtakes_a_worker_full_of_batch_work(tiny, redis_url, redis_client):
    config = worker_config(redis_url, "w1", max_seqs=2, claim_idle_ms=60_000)
    async with running_worker(config, slow(tiny, 0.02)) as worker:
        batch_ids = [f"b{i}" for i in range(4)]
        for request_id in batch_ids:
            await put(redis_client, batch_request(request_id, max_tokens=150))

        async def full_of_batch_work():
            held = [running.request.priority for running in worker.table.running.values()]
            return held.count("batch") == 2 and worker.engine.stats.running == 2

        await wait_for(full_of_batch_work, what="both slots running batch requests")
        # A read that was already blocking when the slots filled may still take one entry; let it time out.
        await asyncio.sleep(READ_BLOCK_MS / 1000 + 0.5)
        await put(redis_client, chat_request("urgent", max_tokens=4))
        urgent = await wait_for(lambda: end_of(redis_client, "urgent"), what="the interactive answer")
        unfinished = [request_id for request_id in batch_ids if await end_of(redis_client, request_id) is None]
        assert urgent["type"] == "done" and urgent["usage"]["completion_tokens"] == 4
        assert unfinished == batch_ids  # it did not wait for a batch request to make room
        assert worker.engine.stats.preemptions >= 1
        for request_id in batch_ids:
            done = await wait_for(lambda: end_of(redis_client, request_id), what=f"batch request {request_id}")
            assert (
                done["type"] == "done"
                and len(streamed_tokens(await reply_events(redis_client, f"out:{request_id}"))) == 150
            )
        await wait_for(lambda: all_acknowledged(redis_client), what="both streams empty")


async def test_a_dead_workers_batch_entries_are_taken_over(tiny, redis_url, redis_client):
    dead = RequestStream(redis_client, BATCH_STREAM, "dead-worker")
    await dead.ensure_group()
    for i in range(3):
        await put(redis_client, batch_request(f"orphan{i}", max_tokens=5))
    assert len(await dead.read_new(3, 100)) == 3  # read, never answered: pending at a dead consumer
    async with running_worker(worker_config(redis_url, "w1", claim_idle_ms=300), tiny):
        for i in range(3):
            done = await wait_for(lambda: end_of(redis_client, f"orphan{i}"), what=f"orphan{i}'s answer")
            assert done["type"] == "done" and done["usage"]["completion_tokens"] == 5
        await wait_for(lambda: all_acknowledged(redis_client), what="both streams empty")


async def test_entries_with_the_same_id_in_both_streams_are_each_answered_and_acknowledged_in_their_own(
    tiny, redis_url, redis_client
):
    for stream in (INTERACTIVE_STREAM, BATCH_STREAM):
        await RequestStream(redis_client, stream, "setup").ensure_group()
    await put(redis_client, chat_request("twin-i", max_tokens=3), entry_id="5-0")
    await put(redis_client, batch_request("twin-b", max_tokens=3), entry_id="5-0")
    async with running_worker(worker_config(redis_url, "w1"), tiny):
        for request_id in ("twin-i", "twin-b"):
            done = await wait_for(lambda: end_of(redis_client, request_id), what=f"{request_id}'s answer")
            assert done["type"] == "done"
        await wait_for(lambda: all_acknowledged(redis_client), what="both streams empty")
