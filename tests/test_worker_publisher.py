"""The per-step transaction: events, progress and acknowledgements land together."""

from __future__ import annotations

import asyncio

import pytest

from protocol import (
    DEAD_LETTER_STREAM,
    REQUEST_GROUP,
    Reply,
    decode_event,
    decode_event_batch,
    delta_event,
    done_event,
    progress_key,
)
from worker.publisher import Publisher

STREAM = "lmq:req:test"


@pytest.fixture
async def publisher(redis_client):
    publisher = Publisher(redis_client, STREAM)
    task = asyncio.create_task(publisher.run())
    yield publisher
    task.cancel()


async def test_one_pubsub_message_per_channel_per_step(publisher, redis_client):
    pubsub = redis_client.pubsub()
    await pubsub.subscribe("lmq:reply:g1")
    await pubsub.get_message(timeout=1)  # the subscribe confirmation
    reply = Reply("pubsub", "lmq:reply:g1")
    publisher.send(reply, delta_event("a", 0, "Hel", [1, 2], 0))
    publisher.send(reply, delta_event("b", 0, "Yo", [3], 0))
    await publisher.flush()
    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
    assert [e["id"] for e in decode_event_batch(message["data"])] == ["a", "b"]
    assert await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2) is None
    await pubsub.aclose()


async def test_reply_stream_is_capped_and_expires(publisher, redis_client):
    reply = Reply("stream", "out:r1")
    publisher.send(reply, delta_event("r1", 0, "Hi", [5], 0))
    publisher.send(reply, done_event("r1", 1, "stop", 3, 1, 0))
    await publisher.flush()
    entries = await redis_client.xrange("out:r1")
    assert [decode_event(fields[b"msg"])["type"] for _, fields in entries] == ["delta", "done"]
    assert 0 < await redis_client.ttl("out:r1") <= 3600


async def test_progress_is_recorded_then_forgotten_with_the_ack(publisher, redis_client):
    await redis_client.xgroup_create(STREAM, REQUEST_GROUP, id="0", mkstream=True)
    entry_id = (await redis_client.xadd(STREAM, {"msg": b"x"})).decode()
    await redis_client.xreadgroup(REQUEST_GROUP, "w1", {STREAM: ">"})
    publisher.record_progress("r1", [7, 8])
    publisher.record_progress("r1", [9])
    await publisher.flush()
    assert await redis_client.lrange(progress_key("r1"), 0, -1) == [b"7", b"8", b"9"]
    publisher.finish(entry_id, "r1")
    await publisher.flush()
    assert not await redis_client.exists(progress_key("r1"))
    assert await redis_client.xlen(STREAM) == 0
    assert (await redis_client.xpending(STREAM, REQUEST_GROUP))["pending"] == 0


async def test_a_failing_write_does_not_stop_the_others(publisher, redis_client):
    await redis_client.set("not-a-stream", "x")
    publisher.send(Reply("stream", "not-a-stream"), delta_event("r1", 0, "Hi", [5], 0))
    publisher.dead_letter(b"\xff", "bad_request", "not msgpack", "w1")
    await publisher.flush()
    [(_, fields)] = await redis_client.xrange(DEAD_LETTER_STREAM)
    assert fields == {b"msg": b"\xff", b"code": b"bad_request", b"message": b"not msgpack", b"worker": b"w1"}
