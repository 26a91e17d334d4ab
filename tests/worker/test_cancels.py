"""Cancellations scoped to their owner, on a real worker (the tiny model) over a real Redis.

A request that carries `cancel_digest` stops only for a cancel presenting the token of that digest;
a cancel without a token (the form older producers send) stops only requests enqueued without one.
A cancel for a request the worker does not run is remembered under the same key, in O(1).
"""

from __future__ import annotations

import dataclasses
import time

import pytest

import protocol
from tests.support.worker_harness import (
    chat_request,
    enqueue,
    final_events,
    reply_events,
    running_worker,
    streamed_tokens,
    wait_for,
    worker_config,
)
from tests.support.worker_process import SlowModel
from worker.cancel_memory import CancelMemory

TOKEN_A, TOKEN_B = "a" * 32, "b" * 32


def owned_request(request_id: str, token: str, **fields) -> protocol.Request:
    return dataclasses.replace(chat_request(request_id, **fields), cancel_digest=protocol.cancel_digest(token))


async def _true(value: bool) -> bool:
    return value


async def _deltas(redis, reply_key: str, at_least: int) -> bool:
    return len(streamed_tokens(await reply_events(redis, reply_key))) >= at_least


async def test_a_cancel_without_the_requests_token_does_not_stop_it(tiny, redis_url, redis_client):
    slow = dataclasses.replace(tiny, model=SlowModel(tiny.model, step_seconds=0.05))
    async with running_worker(worker_config(redis_url, "w1"), slow) as worker:
        await enqueue(redis_client, owned_request("job-77", TOKEN_A, max_tokens=200))
        await wait_for(lambda: _deltas(redis_client, "out:job-77", 1), what="a first delta")
        await redis_client.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message("job-77"))  # no token
        await redis_client.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message("job-77", TOKEN_B))  # another's
        heard = lambda: _true(("job-77", protocol.cancel_digest(TOKEN_B)) in worker.table.early_cancels)  # noqa: E731
        await wait_for(heard, what="both cancellations to reach the worker")
        streamed = len(streamed_tokens(await reply_events(redis_client, "out:job-77")))
        await wait_for(lambda: _deltas(redis_client, "out:job-77", streamed + 3), what="generation to go on")
        assert "job-77" in worker.table.running
        await redis_client.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message("job-77", TOKEN_A))
        events = await final_events(redis_client, "out:job-77")
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "cancelled"
    assert len(streamed_tokens(events)) < 200


async def test_an_early_cancel_reaches_only_the_request_with_its_token(tiny, redis_url, redis_client):
    async with running_worker(worker_config(redis_url, "w1"), tiny) as worker:
        for cancel in (
            protocol.cancel_message("order-42", TOKEN_B),
            protocol.cancel_message("order-42"),
            protocol.cancel_message("order-43", TOKEN_A),
        ):
            await redis_client.publish(protocol.CANCEL_CHANNEL, cancel)
        heard = lambda: _true(("order-43", protocol.cancel_digest(TOKEN_A)) in worker.table.early_cancels)  # noqa: E731
        await wait_for(heard, what="the cancellations to reach the worker")
        await enqueue(redis_client, owned_request("order-42", TOKEN_A, max_tokens=6))
        await enqueue(redis_client, owned_request("order-43", TOKEN_A, max_tokens=200))
        kept = await final_events(redis_client, "out:order-42")
        cancelled = await final_events(redis_client, "out:order-43")
    assert kept[-1]["finish_reason"] == "length" and len(streamed_tokens(kept)) == 6
    assert cancelled[-1]["finish_reason"] == "cancelled" and len(streamed_tokens(cancelled)) < 200


@pytest.mark.slow  # 40,000 cancels: seconds
async def test_a_flood_of_cancels_for_unknown_ids_does_not_hold_up_a_real_one(tiny, redis_url, redis_client):
    """40 000 cancels for ids no worker holds, then one for a running request: all of it must be done
    in seconds. (Rebuilding the memory on every cancel cost O(remembered ids): about 50 s of loop here.)
    The worker shares this test's event loop, so the clock starts before the flood is sent."""
    slow = dataclasses.replace(tiny, model=SlowModel(tiny.model, step_seconds=0.2))
    async with running_worker(worker_config(redis_url, "w1"), slow) as worker:
        await enqueue(redis_client, owned_request("victim", TOKEN_A, max_tokens=200))
        await wait_for(lambda: _deltas(redis_client, "out:victim", 1), what="a first delta")
        sent = time.monotonic()
        for start in range(0, 40_000, 1000):
            pipe = redis_client.pipeline(transaction=False)
            for i in range(start, start + 1000):
                pipe.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message(f"gone-{i}", TOKEN_B))
            await pipe.execute()
        await redis_client.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message("victim", TOKEN_A))
        events = await final_events(redis_client, "out:victim")
        took = time.monotonic() - sent
        assert len(worker.table.early_cancels) == 40_000
    assert events[-1]["finish_reason"] == "cancelled"
    assert took < 20.0, f"the flood and the cancel behind it took {took:.1f} s"


def test_the_memory_forgets_expired_cancels_and_keeps_a_bounded_number():
    now = [0.0]
    memory = CancelMemory(seconds=120.0, limit=3, clock=lambda: now[0])
    memory.remember(("a", None))
    now[0] = 60.0
    memory.remember(("b", "d"))
    assert ("a", None) in memory and ("b", None) not in memory
    now[0] = 121.0
    memory.remember(("c", None))
    assert ("a", None) not in memory and len(memory) == 2  # "a" expired and left
    memory.remember(("d", None))
    memory.remember(("e", None))
    assert len(memory) == 3 and ("b", "d") not in memory  # over the limit: the oldest went
    assert memory.take(("e", None)) and not memory.take(("e", None))
    now[0] = 500.0
    assert not memory.take(("d", None))  # expired
    assert len(memory) == 0
