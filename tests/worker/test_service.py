"""The worker service end to end, in process: a real Redis, the tiny model, the real engine."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

import protocol
from lmq.redis_server import find_redis_server, free_tcp_port
from protocol import DEAD_LETTER_STREAM, REQUEST_GROUP, progress_key
from protocol.keys import INTERACTIVE
from tests.support.worker_harness import (
    STREAM,
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
from worker.claims import Entry, EntryRef, RequestStream
from worker.stub_model import stub_model


async def test_a_request_streams_deltas_then_done_and_leaves_nothing_behind(tiny, redis_url, redis_client):
    async with running_worker(worker_config(redis_url, "w1"), tiny):
        await enqueue(redis_client, chat_request("r1", max_tokens=6))
        events = await final_events(redis_client, "out:r1")
    done = events[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert len(streamed_tokens(events)) == done["usage"]["completion_tokens"] == 6
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert await redis_client.xlen(STREAM) == 0
    assert (await redis_client.xpending(STREAM, REQUEST_GROUP))["pending"] == 0
    assert not await redis_client.exists(progress_key("r1"))
    assert not await redis_client.exists(protocol.worker_key("w1"))  # deleted on graceful stop


async def test_two_workers_share_one_stream(tiny, redis_url, redis_client):
    # Neither worker dies, so neither may claim the other's entries: with the tests' usual 600 ms
    # claim time, a keep-alive delayed by a loaded machine would let one take over the other's request.
    settings = dict(max_seqs=2, claim_idle_ms=60_000)
    async with running_worker(worker_config(redis_url, "w1", **settings), tiny) as first:
        async with running_worker(worker_config(redis_url, "w2", **settings), tiny) as second:
            ids = [f"r{i}" for i in range(8)]
            for request_id in ids:
                await enqueue(redis_client, chat_request(request_id, max_tokens=24))
            for request_id in ids:
                assert (await final_events(redis_client, f"out:{request_id}"))[-1]["type"] == "done"
            served = [
                w.metrics.registry.get_sample_value(
                    "lmq_requests_finished_total", {"model": "tiny", "outcome": "length"}
                )
                or 0
                for w in (first, second)
            ]
    assert sum(served) == 8
    assert min(served) > 0


async def test_cancellation_stops_the_sequence_and_frees_its_pages(tiny, redis_url, redis_client):
    # At least 0.05 s a step: 200 tokens take 10 s, so the cancel always lands mid-generation.
    slow = dataclasses.replace(tiny, model=SlowModel(tiny.model, step_seconds=0.05))
    async with running_worker(worker_config(redis_url, "w1"), slow) as worker:
        await enqueue(redis_client, chat_request("long", max_tokens=200))
        await wait_for(lambda: reply_events(redis_client, "out:long"), what="a first delta")
        await redis_client.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message("long"))
        events = await final_events(redis_client, "out:long")
        assert events[-1]["finish_reason"] == "cancelled"
        assert len(streamed_tokens(events)) < 200
        assert worker.engine.stats.kv_pages_used == 0
        assert "long" not in worker.table.running


async def test_bad_entries_are_answered_dead_lettered_acked_and_the_worker_goes_on(tiny, redis_url, redis_client):
    good = chat_request("good", max_tokens=4)
    wrong_version = {**good.to_dict(), "id": "old", "reply": {"kind": "stream", "key": "out:old"}, "v": 99}
    async with running_worker(worker_config(redis_url, "w1"), tiny):
        await redis_client.xadd(STREAM, {"other": b"no msg field"})
        await redis_client.xadd(STREAM, {"msg": b"\x93\x01\x02"})  # msgpack, but a list
        await redis_client.xadd(STREAM, {"msg": b"\x80" + b" " * protocol.MAX_MESSAGE_BYTES})
        await redis_client.xadd(STREAM, {"msg": protocol.encode(wrong_version)})
        await enqueue(redis_client, chat_request("late", deadline_s=-1))
        await enqueue(redis_client, chat_request("huge", prompt_ids=[5] * 300))
        await enqueue(redis_client, chat_request("bad-token", prompt_ids=[10**6]))
        await enqueue(redis_client, good)
        assert (await final_events(redis_client, "out:good"))[-1]["type"] == "done"
        errors = {
            key: (await final_events(redis_client, f"out:{key}"))[-1] for key in ("old", "late", "huge", "bad-token")
        }
        await wait_for(lambda: _all_acked(redis_client), what="every entry acknowledged")
    assert {key: e["code"] for key, e in errors.items()} == {
        "old": "unsupported_version",
        "late": "timeout",
        "huge": "prompt_too_long",
        "bad-token": "bad_request",
    }
    assert errors["old"]["id"] == "old"
    dead = [fields[b"code"] for _, fields in await redis_client.xrange(DEAD_LETTER_STREAM)]
    assert dead == [b"bad_request", b"bad_request", b"too_large", b"unsupported_version", b"bad_request"]


async def test_a_duplicate_id_is_refused_while_the_first_runs(tiny, redis_url, redis_client):
    # At least 0.05 s a step: the first twin runs for 10 s, so the second always arrives while it runs.
    slow = dataclasses.replace(tiny, model=SlowModel(tiny.model, step_seconds=0.05))
    async with running_worker(worker_config(redis_url, "w1"), slow):
        await enqueue(redis_client, chat_request("twin", max_tokens=200))
        await wait_for(lambda: reply_events(redis_client, "out:twin"), what="a first delta")
        await enqueue(redis_client, chat_request("twin", max_tokens=4))
        error = await wait_for(lambda: _first_error(redis_client, "out:twin"), what="the duplicate's error")
        await redis_client.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message("twin"))
        await final_events(redis_client, "out:twin")
    assert error["code"] == "duplicate_id"


async def test_a_claimed_entry_continues_after_the_tokens_already_streamed(tiny, redis_url, redis_client):
    async with running_worker(worker_config(redis_url, "w1"), tiny):
        await enqueue(redis_client, chat_request("clean", max_tokens=12))
        clean = streamed_tokens(await final_events(redis_client, "out:clean"))
    # A worker read "resumed", streamed its first 5 tokens, and died.
    await _pending_at_dead_worker(
        redis_client, chat_request("resumed", max_tokens=12), deliveries=1, progress=clean[:5]
    )
    await redis_client.xadd(
        "out:resumed", {"msg": protocol.encode(protocol.delta_event("resumed", 0, "", clean[:5], 0))}
    )
    async with running_worker(worker_config(redis_url, "w2"), tiny):
        events = await final_events(redis_client, "out:resumed")
    assert events[1]["offset"] == 5
    assert streamed_tokens(events) == clean
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert not await redis_client.exists(progress_key("resumed"))


async def test_retry_limit_moves_the_entry_to_the_dead_letters(tiny, redis_url, redis_client):
    await _pending_at_dead_worker(redis_client, chat_request("cursed"), deliveries=2, progress=[])
    async with running_worker(worker_config(redis_url, "w1", max_attempts=2), tiny):
        error = (await final_events(redis_client, "out:cursed"))[-1]
        await wait_for(lambda: _all_acked(redis_client), what="the entry acknowledged")
    assert error["code"] == "retry_limit"
    [(_, fields)] = await redis_client.xrange(DEAD_LETTER_STREAM)
    assert fields[b"code"] == b"retry_limit"
    assert protocol.decode_request(fields[b"msg"]).id == "cursed"


@pytest.mark.slow  # waits for a 3 s deadline: seconds
async def test_a_request_past_its_deadline_while_running_times_out(tiny, redis_url, redis_client):
    # 200 steps of at least 0.1 s cannot finish within the 3 s deadline, and 3 s leave a loaded
    # machine time to start the request and stream some of it first (within 0.5 s it might not).
    slow = dataclasses.replace(tiny, model=SlowModel(tiny.model, step_seconds=0.1))
    async with running_worker(worker_config(redis_url, "w1", claim_idle_ms=300), slow) as worker:
        await enqueue(redis_client, chat_request("slow", max_tokens=200, deadline_s=3.0))
        events = await final_events(redis_client, "out:slow")
        assert worker.engine.stats.kv_pages_used == 0
    assert events[-1]["type"] == "error"
    assert events[-1]["code"] == "timeout"
    assert 0 < len(streamed_tokens(events)) < 200


async def _pending_at_dead_worker(redis, request: protocol.Request, *, deliveries: int, progress: list[int]) -> str:
    """Put `request` in the stream as if a worker read it, streamed `progress`, and died; it was delivered `deliveries` times."""
    await RequestStream(redis, STREAM, "dead-worker").ensure_group()
    entry_id = await enqueue(redis, request)
    await redis.xreadgroup(REQUEST_GROUP, "dead-worker", {STREAM: ">"}, count=1)
    for _ in range(deliveries - 1):
        await redis.xclaim(STREAM, REQUEST_GROUP, "dead-worker", 0, [entry_id])
    if progress:
        await redis.set(progress_key(request.id), protocol.encode_progress(progress))
    return entry_id


async def _all_acked(redis) -> bool:
    return await redis.xlen(STREAM) == 0 and (await redis.xpending(STREAM, REQUEST_GROUP))["pending"] == 0


async def _first_error(redis, reply_key: str) -> dict | None:
    return next((e for e in await reply_events(redis, reply_key) if e["type"] == "error"), None)


async def test_the_stub_model_answers_through_the_whole_queue(tiny, redis_url, redis_client):
    async with running_worker(worker_config(redis_url, "w1"), stub_model(tiny, " the")):
        await enqueue(redis_client, chat_request("stubbed", max_tokens=5))
        events = await final_events(redis_client, "out:stubbed")
    assert streamed_tokens(events) == tiny.tokenizer.encode(" the", add_special_tokens=False).ids[:1] * 5


async def test_a_password_protected_redis(tiny, redis_client):
    port = free_tcp_port()
    command = [find_redis_server(), "--port", str(port), "--requirepass", "s3cret", "--save", "", "--appendonly", "no"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    url = f"redis://:s3cret@127.0.0.1:{port}/0"
    client = aioredis.Redis.from_url(url)
    try:
        await wait_for(lambda: _answers(client), what="the password-protected redis")
        async with running_worker(worker_config(url, "w1"), tiny):
            await enqueue(client, chat_request("locked", max_tokens=3))
            assert (await final_events(client, "out:locked"))[-1]["type"] == "done"
    finally:
        await client.aclose()
        server.terminate()
        server.wait()


async def _answers(client) -> bool:
    try:
        return await client.ping()
    except RedisError:
        return False


async def test_stopping_survives_a_task_that_swallows_its_cancellation():
    """redis-py (and Python 3.11's wait_for) can lose a cancellation: the worker's stop must not hang on it."""
    from worker.service import _cancel

    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > 1:
                    raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(_cancel([task]), 10)
    assert task.cancelled() and swallowed == 2


async def test_a_worker_that_claims_back_an_entry_it_is_running_keeps_running_it(tiny, redis_url, redis_client):
    """A worker that stalled past the claim time (SIGSTOP, a long pause) may XAUTOCLAIM its own entries
    on waking, before its keep loop refreshed them: XAUTOCLAIM does not skip the caller's own. Such an
    entry is running here already and must go on, not be refused as a duplicate (the chaos soak saw
    batch items fail with "request ... is already running" after a worker's SIGSTOP)."""
    slow = dataclasses.replace(tiny, model=SlowModel(tiny.model, step_seconds=0.05))
    async with running_worker(worker_config(redis_url, "w1"), slow) as worker:
        entry_id = await enqueue(redis_client, chat_request("mine", max_tokens=40))

        async def running() -> bool:
            return "mine" in worker.table.running

        await wait_for(running, what="the request running")
        [(_, fields)] = await redis_client.xrange(STREAM, entry_id, entry_id)
        await worker._admit(
            Entry(EntryRef(INTERACTIVE, entry_id), fields), claimed=True
        )  # what the claim loop does with it
        events = await final_events(redis_client, "out:mine")
    assert events[-1]["type"] == "done", events[-1]
    assert len(streamed_tokens(events)) == 40
    assert await redis_client.xlen(DEAD_LETTER_STREAM) == 0


async def test_an_entry_whose_last_writes_are_still_on_their_way_is_not_run_again(tiny, redis_url, redis_client):
    """A request the engine finished while Redis refused its writes (a cluster slot down) is no longer
    running, but its entry stays pending until the publisher's retried writes land and acknowledge it.
    The claim loop may take that entry back first (its keep loop failed through the outage too): it is
    still this worker's, and a second run from the progress record would replace the events kept for a
    resume (a cluster test saw the resume answered `unavailable`)."""
    async with running_worker(worker_config(redis_url, "w1"), tiny) as worker:
        gate, script = asyncio.Event(), worker.publisher._script

        async def refused_until_the_gate_opens(*args, **kwargs):
            await gate.wait()
            return await script(*args, **kwargs)

        worker.publisher._script = refused_until_the_gate_opens
        entry_id = await enqueue(redis_client, chat_request("mine", max_tokens=8))
        await wait_for(lambda: _finished_here(worker, "mine"), what="the engine's end of the request")
        [(_, fields)] = await redis_client.xrange(STREAM, entry_id, entry_id)
        await worker._admit(Entry(EntryRef(INTERACTIVE, entry_id), fields), claimed=True)  # the claim loop's
        ran_again = "mine" in worker.table.running
        gate.set()
        events = await final_events(redis_client, "out:mine")
    assert not ran_again, "the entry was run a second time"
    assert [event["type"] for event in events].count("done") == 1 and len(streamed_tokens(events)) == 8


async def _finished_here(worker, request_id: str) -> bool:
    kept = worker.publisher.sent_events.get(request_id)
    return kept is not None and request_id not in worker.table.running and kept.ended_at is not None
