"""The batch runner's promises, in process: one driver per batch (the lease), a takeover when its
gateway stops, and a run whose queue entry vanished is run again, so every item gets one outcome."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest

import protocol
from protocol.keys import batch_key
from tests.support.batch_files import chat_line, create_batch, file_lines, openai_batch_end, openai_client, poll, slow
from tests.support.gateway_harness import REAL_MODEL, announce, real_worker, running_gateway

BATCH_STREAM = protocol.request_stream(REAL_MODEL, "batch")


def numbered(count: int, max_tokens: int = 4) -> list[dict]:
    return [chat_line(f"r{i}", f"Say {i}", max_tokens=max_tokens) for i in range(count)]


@pytest.mark.slow  # seconds of batch runs: seconds
async def test_items_whose_queue_entries_vanished_run_again(redis_url, redis_client, tiny):
    await announce(redis_client, REAL_MODEL)  # "served": the batch may be created, but no worker reads yet
    async with running_gateway(redis_url) as url:
        client = openai_client(url)
        batch = await create_batch(client, numbered(6))

        async def enqueued():
            return await redis_client.xlen(BATCH_STREAM) == 6

        await poll(enqueued, what="six items in the batch stream")
        await redis_client.delete(BATCH_STREAM)  # the entries are lost (as with a Redis that lost its data)

        async def enqueued_again():
            runs = await redis_client.hvals(batch_key(batch.id, "inflight"))
            return (
                len(runs) == 6
                and all(run.startswith(b"2 ") for run in runs)
                and await redis_client.xlen(BATCH_STREAM) == 6
            )

        await poll(enqueued_again, what="every item enqueued again, as attempt 2")
        async with real_worker(redis_url, tiny):
            done = await openai_batch_end(client, batch.id)
            lines = await file_lines(client, done.output_file_id)
    assert done.status == "completed" and done.request_counts.completed == 6
    assert Counter(line["custom_id"] for line in lines) == Counter(f"r{i}" for i in range(6))
    assert all(line["response"]["request_id"].endswith(".2") for line in lines)


@pytest.mark.slow  # 16 items on slowed steps: seconds
async def test_one_gateway_drives_a_batch_and_another_takes_over_when_it_stops(redis_url, redis_client, tiny):
    lease = None
    async with real_worker(redis_url, slow(tiny, 0.05), max_seqs=2), contextlib.AsyncExitStack() as outer:
        gateways = {}
        for name in ("gw-a", "gw-b"):
            stack = await outer.enter_async_context(contextlib.AsyncExitStack())
            gateways[name] = (stack, await stack.enter_async_context(running_gateway(redis_url, gateway_id=name)))
        batch = await create_batch(openai_client(gateways["gw-a"][1]), numbered(16, max_tokens=8))  # 4 before the stop
        lease = batch_key(batch.id, "lease")
        holder = (await poll(lambda: redis_client.get(lease), what="a gateway to take the lease")).decode()
        other = "gw-b" if holder == "gw-a" else "gw-a"
        client = openai_client(gateways[other][1])
        await poll(lambda: _some_finished(client, batch.id), what="some items to finish")
        await gateways[holder][0].aclose()  # a graceful stop releases the lease at once

        async def taken_over():
            return await redis_client.get(lease) == other.encode()

        await poll(taken_over, what=f"{other} to take the batch over")
        done = await openai_batch_end(client, batch.id)
        lines = await file_lines(client, done.output_file_id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (16, 0)
    assert Counter(line["custom_id"] for line in lines) == Counter(f"r{i}" for i in range(16))


async def _some_finished(client, batch_id: str) -> bool:
    return (await client.batches.retrieve(batch_id)).request_counts.completed >= 4
