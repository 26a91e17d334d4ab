"""The per-step transaction: events, progress and acknowledgements land together."""

from __future__ import annotations

import asyncio
import time

import pytest

from protocol import (
    DEAD_LETTER_STREAM,
    MAX_MESSAGE_BYTES,
    REQUEST_GROUP,
    Reply,
    decode_event,
    decode_event_batch,
    decode_progress,
    delta_event,
    done_event,
    encode_event_batch,
    progress_key,
)
from protocol.keys import INTERACTIVE
from worker.claims import EntryRef, Lane
from worker.publisher import DEAD_LETTER_PREFIX_BYTES, Publisher

STREAM = "lmq:req:test"
LANES = [Lane(INTERACTIVE, STREAM)]
WAIT_S = 60.0  # for a message already published: it comes at once unless the machine is very busy


def ref(entry_id: str) -> EntryRef:
    return EntryRef(INTERACTIVE, entry_id)


async def subscribed(redis, channel: str):
    """A pub/sub connection that Redis confirmed subscribed to `channel`: what is published next reaches it."""
    pubsub = redis.pubsub()
    await pubsub.subscribe(channel)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        message = await pubsub.get_message(timeout=1)
        if message is not None and message["type"] == "subscribe":
            return pubsub
    raise AssertionError(f"no confirmation of the subscription to {channel} within {WAIT_S} s")


@pytest.fixture
async def publisher(redis_client):
    publisher = Publisher(redis_client, LANES, "w1")
    task = asyncio.create_task(publisher.run())
    yield publisher
    task.cancel()


async def test_one_pubsub_message_per_channel_per_step(publisher, redis_client):
    pubsub = await subscribed(redis_client, "lmq:reply:g1")
    reply = Reply("pubsub", "lmq:reply:g1")
    publisher.send(ref("1-1"), reply, delta_event("a", 0, "Hel", [1, 2], 0))
    publisher.send(ref("1-2"), reply, delta_event("b", 0, "Yo", [3], 0))
    await publisher.flush()
    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=WAIT_S)
    assert [e["id"] for e in decode_event_batch(message["data"])] == ["a", "b"]
    assert await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2) is None
    await pubsub.aclose()


async def test_reply_stream_is_capped_and_expires(publisher, redis_client):
    reply = Reply("stream", "out:r1")
    publisher.send(ref("1-1"), reply, delta_event("r1", 0, "Hi", [5], 0))
    publisher.send(ref("1-1"), reply, done_event("r1", 1, "stop", 3, 1, 0))
    await publisher.flush()
    entries = await redis_client.xrange("out:r1")
    assert [decode_event(fields[b"msg"])["type"] for _, fields in entries] == ["delta", "done"]
    assert 0 < await redis_client.ttl("out:r1") <= 3600


async def test_progress_is_recorded_then_forgotten_with_the_ack(publisher, redis_client):
    await redis_client.xgroup_create(STREAM, REQUEST_GROUP, id="0", mkstream=True)
    entry = ref((await redis_client.xadd(STREAM, {"msg": b"x"})).decode())
    await redis_client.xreadgroup(REQUEST_GROUP, "w1", {STREAM: ">"})
    publisher.record_progress(entry, "r1", 0, [7, 8])
    await publisher.flush()
    publisher.record_progress(entry, "r1", 2, [9])
    await publisher.flush()
    assert decode_progress(await redis_client.get(progress_key("r1"))) == [7, 8, 9]
    publisher.finish(entry, "r1")
    await publisher.flush()
    assert not await redis_client.exists(progress_key("r1"))
    assert await redis_client.xlen(STREAM) == 0
    assert (await redis_client.xpending(STREAM, REQUEST_GROUP))["pending"] == 0


async def test_a_refused_reply_fails_its_request_alone(redis_client):
    refused = []
    publisher = Publisher(redis_client, LANES, "w1", on_refused=lambda *args: refused.append(args))
    task = asyncio.create_task(publisher.run())
    await redis_client.set("not-a-stream", "x")
    denied = await _owned_entry(redis_client, "w1")
    publisher.send(denied, Reply("stream", "not-a-stream"), delta_event("r1", 0, "Hi", [5], 0))
    publisher.send(ref("1-2"), Reply("stream", "out:r2"), delta_event("r2", 0, "Yo", [6], 0))
    publisher.dead_letter(ref("1-3"), b"\xff", "bad_request", "not msgpack")
    await publisher.flush()
    task.cancel()
    assert [(entry, status) for entry, status, _ in refused] == [(denied, "denied")]
    assert "WRONGTYPE" in refused[0][2]
    assert [decode_event(fields[b"msg"])["id"] for _, fields in await redis_client.xrange("out:r2")] == ["r2"]
    letters = [fields for _, fields in await redis_client.xrange(DEAD_LETTER_STREAM)]
    assert [fields[b"code"] for fields in letters] == [b"reply_denied", b"bad_request"]
    assert letters[0][b"msg"] == b"x"  # the entry's own msg
    assert letters[1] == {b"msg": b"\xff", b"code": b"bad_request", b"message": b"not msgpack", b"worker": b"w1"}


async def test_a_batch_of_many_events_is_the_protocols_own_encoding(publisher, redis_client):
    pubsub = await subscribed(redis_client, "lmq:reply:g1")
    events = [delta_event(f"r{i}", 0, "x", [i], 0) for i in range(20)]  # past msgpack's 15-item fixarray
    for i, event in enumerate(events):
        publisher.send(ref(f"1-{i}"), Reply("pubsub", "lmq:reply:g1"), event)
    await publisher.flush()
    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=WAIT_S)
    assert message["data"] == encode_event_batch(events)
    await pubsub.aclose()


async def _owned_entry(redis, consumer: str) -> EntryRef:
    await redis.xgroup_create(STREAM, REQUEST_GROUP, id="0", mkstream=True)
    entry_id = (await redis.xadd(STREAM, {"msg": b"x"})).decode()
    await redis.xreadgroup(REQUEST_GROUP, consumer, {STREAM: ">"})
    return ref(entry_id)


async def test_a_worker_that_lost_its_entry_writes_nothing_for_it(redis_client):
    refused = []
    stale = Publisher(redis_client, LANES, "stale", on_refused=lambda *args: refused.append(args))
    task = asyncio.create_task(stale.run())
    entry = await _owned_entry(redis_client, "stale")
    await redis_client.xclaim(STREAM, REQUEST_GROUP, "new-owner", 0, [entry.entry_id])  # taken over while stale stalled
    stale.send(entry, Reply("stream", "out:r1"), delta_event("r1", 3, "late", [9], 3))
    stale.record_progress(entry, "r1", 3, [9])
    stale.finish(entry, "r1")
    await stale.flush()
    task.cancel()
    assert [(entry, status) for entry, status, _ in refused] == [(entry, "lost")]
    assert not await redis_client.exists("out:r1", progress_key("r1"))
    [pending] = await redis_client.xpending_range(STREAM, REQUEST_GROUP, min="-", max="+", count=10)
    assert pending["consumer"] == b"new-owner"


async def test_a_step_sent_twice_is_written_once(redis_client):
    """A retry after a lost reply (the script ran, its answer did not arrive) must not duplicate anything."""
    publisher = Publisher(redis_client, LANES, "w1")
    entry = await _owned_entry(redis_client, "w1")
    publisher.send(entry, Reply("stream", "out:r1"), delta_event("r1", 0, "Hi", [5], 0))
    publisher.record_progress(entry, "r1", 0, [5])
    writes = publisher._pending
    await publisher._send(writes)
    publisher._step -= 1  # the same step again, as the retry loop sends it
    await publisher._send(writes)
    assert len(await redis_client.xrange("out:r1")) == 1
    assert decode_progress(await redis_client.get(progress_key("r1"))) == [5]


async def test_a_refused_reply_is_dead_lettered_once_whatever_follows(redis_client):
    """Steps already queued for a request whose reply was refused must not dead-letter it again."""
    publisher = Publisher(redis_client, LANES, "w1")
    task = asyncio.create_task(publisher.run())
    entry = await _owned_entry(redis_client, "w1")
    await redis_client.set("not-a-stream", "x")
    for token in range(3):
        publisher.send(entry, Reply("stream", "not-a-stream"), delta_event("r1", token, "x", [token], token))
        await publisher.flush()
    task.cancel()
    assert [fields[b"code"] for _, fields in await redis_client.xrange(DEAD_LETTER_STREAM)] == [b"reply_denied"]
    assert (await redis_client.xpending(STREAM, REQUEST_GROUP))["pending"] == 0


async def test_a_step_over_shards_writes_each_shard_with_its_own_keys(redis_client):
    """The lanes of two shards (a cluster's layout, here on one Redis): one step's writes reach each
    entry's own stream, progress key and dead-letter stream, and the applied-step fence is per shard."""
    from protocol.keys import sharded
    from worker.claims import RequestStreams, model_lanes

    layout = sharded(2)
    lanes = model_lanes(layout, "m")
    streams = RequestStreams(redis_client, lanes, "w1")
    await streams.ensure_group()
    first, second = (lane for lane in lanes if lane.priority == "interactive")
    handles = []
    for lane in (first, second):
        await redis_client.xadd(lane.stream, {"msg": b"x"})
        [entry] = await streams.read_new(lane.name, 1, 100)
        handles.append(entry.ref)
    assert handles[0] != handles[1] and handles[1].lane == second.name  # the second shard's entries carry their lane
    publisher = Publisher(redis_client, lanes, "w1")
    task = asyncio.create_task(publisher.run())
    try:
        for handle, request_id in zip(handles, ("r0", "r1")):
            publisher.record_progress(handle, request_id, 0, [4, 2])
        publisher.dead_letter(handles[1], b"x", "bad_request", "test")
        await publisher.flush()
        for lane, request_id in zip((first, second), ("r0", "r1")):
            assert decode_progress(await redis_client.get(lane.shard.progress_key(request_id))) == [4, 2]
            assert await redis_client.get(progress_key(request_id)) is None  # no unsharded name
        assert await redis_client.xlen(second.shard.dead_letter_stream) == 1
        assert await redis_client.xlen(first.shard.dead_letter_stream) == 0
        for handle, request_id in zip(handles, ("r0", "r1")):
            publisher.finish(handle, request_id)
        await publisher.flush()
        for lane in (first, second):
            assert await redis_client.xlen(lane.stream) == 0  # acknowledged and deleted in its own stream
            assert len(await redis_client.keys(lane.shard.key("applied:w1:*"))) == 1
    finally:
        task.cancel()


async def test_a_sharded_pubsub_reply_is_spublished(publisher, redis_client):
    """Reply kind `spubsub`: the step's events for the channel in one SPUBLISH, heard by SSUBSCRIBE (Redis 7+)."""
    if int((await redis_client.info("server"))["redis_version"].split(".")[0]) < 7:
        pytest.skip("sharded pub/sub needs Redis 7")
    pubsub = redis_client.pubsub()
    await pubsub.ssubscribe("lmq:reply:s1")
    assert (await pubsub.get_message(timeout=WAIT_S))["type"] == "ssubscribe"
    plain = await subscribed(redis_client, "lmq:reply:s1")
    publisher.send(ref("1-1"), Reply("spubsub", "lmq:reply:s1"), delta_event("a", 0, "Hi", [1], 0))
    publisher.send(ref("1-2"), Reply("spubsub", "lmq:reply:s1"), delta_event("b", 0, "Yo", [2], 0))
    await publisher.flush()
    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=WAIT_S)
    assert message["type"] == "smessage" and [e["id"] for e in decode_event_batch(message["data"])] == ["a", "b"]
    assert await plain.get_message(ignore_subscribe_messages=True, timeout=0.2) is None  # not a plain PUBLISH
    await pubsub.aclose()
    await plain.aclose()


# ---------------------------------------------------------------- one request's output never breaks another's


async def _messages(pubsub, count: int) -> list[bytes]:
    found = []
    while len(found) < count:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=WAIT_S)
        assert message is not None, f"{len(found)} of {count} messages came"
        found.append(message["data"])
    return found


async def test_a_step_whose_events_exceed_the_message_limit_is_split_and_each_message_fits(publisher, redis_client):
    """Three 400 KB deltas and a small one on one channel: every event arrives, in order, no message over the limit."""
    pubsub = await subscribed(redis_client, "lmq:reply:g1")
    reply = Reply("pubsub", "lmq:reply:g1")
    for index, name in enumerate("abc"):
        publisher.send(ref(f"1-{index + 1}"), reply, delta_event(name, 0, "x" * 400_000, [1], 0))
    publisher.send(ref("1-4"), reply, delta_event("d", 0, "small", [2], 0))
    await publisher.flush()
    messages = await _messages(pubsub, 2)
    assert all(len(data) <= MAX_MESSAGE_BYTES for data in messages)
    events = [event for data in messages for event in decode_event_batch(data)]
    assert [(e["id"], len(e["text"])) for e in events] == [("a", 400_000), ("b", 400_000), ("c", 400_000), ("d", 5)]
    assert await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2) is None
    await pubsub.aclose()


async def test_an_event_too_large_for_any_message_fails_its_own_request_alone(redis_client):
    """A tokenize answer of 1.25 MB beside three streams' deltas: the streams' events arrive, the big
    request gets a `too_large` error instead, its entry is acknowledged, and it is reported refused."""
    await redis_client.xgroup_create(STREAM, REQUEST_GROUP, id="0", mkstream=True)
    entries = [ref((await redis_client.xadd(STREAM, {"msg": b"x"})).decode()) for _ in range(4)]
    await redis_client.xreadgroup(REQUEST_GROUP, "w1", {STREAM: ">"}, count=4)
    refused = []
    publisher = Publisher(redis_client, LANES, "w1", on_refused=lambda *args: refused.append(args))
    task = asyncio.create_task(publisher.run())
    pubsub = await subscribed(redis_client, "lmq:reply:g1")
    reply = Reply("pubsub", "lmq:reply:g1")
    for index, name in enumerate("abc"):
        publisher.send(entries[index], reply, delta_event(name, 3, "tok", [5], 3))
    huge = done_event("tok", 0, "tokenized", 300_000, 0, 0, prompt_ids=list(range(300_000)), pieces=["xy"] * 300_000)
    publisher.send(entries[3], reply, huge)
    publisher.finish(entries[3], None)
    publisher.send(entries[1], reply, delta_event("b", 4, "more", [6], 4))
    await publisher.flush()
    data = (await _messages(pubsub, 1))[0]
    events = decode_event_batch(data)
    assert [(e["id"], e["type"], e["seq"]) for e in events] == [
        ("a", "delta", 3),
        ("b", "delta", 3),
        ("b", "delta", 4),
        ("c", "delta", 3),
        ("tok", "error", 0),
    ]
    assert events[4]["code"] == "too_large"
    assert [(entry, status) for entry, status, _ in refused] == [(entries[3], "too_large")]
    assert (await redis_client.xpending(STREAM, REQUEST_GROUP))["pending"] == 3  # the big one was acknowledged
    task.cancel()
    await pubsub.aclose()


async def test_a_dead_letter_keeps_a_bounded_prefix_of_a_huge_entry(publisher, redis_client):
    raw = b"\xc1" * (16 << 20)
    publisher.dead_letter(ref("1-1"), raw, "too_large", "message is 16 MiB")
    publisher.finish(ref("1-1"), None)
    await publisher.flush()
    [(_, fields)] = await redis_client.xrange(DEAD_LETTER_STREAM)
    assert fields[b"msg"] == raw[:DEAD_LETTER_PREFIX_BYTES]
    assert f"was {len(raw)} bytes".encode() in fields[b"message"]
