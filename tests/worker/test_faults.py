"""Faults a worker meets at its Redis end, in process: a real Redis (both kinds where the server's
behaviour differs), the tiny model, the real engine. Each states what the producer sees, what is
left in Redis, and that the worker keeps serving."""

from __future__ import annotations

import msgpack
import pytest
import redis.asyncio as aioredis

import protocol
from protocol import DEAD_LETTER_STREAM, REQUEST_GROUP
from tests.support.redis_acl import create_lmq_user
from tests.support.worker_harness import (
    STREAM,
    chat_request,
    enqueue,
    final_events,
    running_worker,
    streamed_tokens,
    wait_for,
    worker_config,
)


async def _nothing_pending(redis) -> bool:
    return (await redis.xpending(STREAM, REQUEST_GROUP))["pending"] == 0


async def _dead_letter_codes(redis) -> list[bytes]:
    return [fields[b"code"] for _, fields in await redis.xrange(DEAD_LETTER_STREAM)]


async def test_a_reply_key_the_worker_may_not_write_fails_that_request_alone(tiny, any_redis_url):
    """An ACL that limits lmq to lmq:* refuses a producer's reply key in its own namespace."""
    admin = aioredis.Redis.from_url(any_redis_url)
    limited_url = create_lmq_user(any_redis_url)
    async with running_worker(worker_config(limited_url, "w1", max_seqs=4), tiny) as worker:
        bad_stream = chat_request("bad-stream", max_tokens=6)
        bad_stream = protocol.Request(**{**bad_stream.__dict__, "reply": protocol.Reply("stream", "myapp:reply:1")})
        bad_channel = protocol.Request(
            **{**bad_stream.__dict__, "id": "bad-channel", "reply": protocol.Reply("pubsub", "myapp:replies")}
        )
        good = protocol.Request(
            **{**chat_request("good", max_tokens=6).__dict__, "reply": protocol.Reply("stream", "lmq:reply:test:good")}
        )
        for request in (bad_stream, bad_channel, good):
            await enqueue(admin, request)
        events = await final_events(admin, "lmq:reply:test:good")
        assert events[-1]["type"] == "done" and len(streamed_tokens(events)) == 6
        await wait_for(lambda: _nothing_pending(admin), what="every entry acknowledged")
        assert sorted(await _dead_letter_codes(admin)) == [b"reply_denied", b"reply_denied"]
        assert not await admin.exists("myapp:reply:1")
        assert not worker.table.running
        await enqueue(
            admin,
            protocol.Request(
                **{**good.__dict__, "id": "after", "reply": protocol.Reply("stream", "lmq:reply:test:after")}
            ),
        )
        assert (await final_events(admin, "lmq:reply:test:after"))[-1]["type"] == "done"  # and it goes on serving
    await admin.aclose()


async def test_a_lost_consumer_group_is_recreated(tiny, redis_url, redis_client):
    """After FLUSHALL (or a Redis restarted without persistence) a producer's XADD makes a stream with no group."""
    async with running_worker(worker_config(redis_url, "w1"), tiny):
        await enqueue(redis_client, chat_request("before"))
        await final_events(redis_client, "out:before")
        await redis_client.flushall()
        await enqueue(redis_client, chat_request("after"))
        events = await final_events(redis_client, "out:after")
    assert events[-1]["type"] == "done"


async def test_a_cancel_that_arrives_before_the_request_starts_is_not_lost(tiny, redis_url, redis_client):
    async with running_worker(worker_config(redis_url, "w1"), tiny) as worker:
        await redis_client.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message("early"))
        await wait_for(
            lambda: _true(("early", None) in worker.table.early_cancels), what="the cancellation to reach the worker"
        )
        await enqueue(redis_client, chat_request("early", max_tokens=200))
        events = await final_events(redis_client, "out:early")
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "cancelled"
    assert len(streamed_tokens(events)) < 200


async def _true(value: bool) -> bool:
    return value


def _raw_request(**overrides) -> bytes:
    data = {
        "v": 1,
        "id": "raw",
        "model": "tiny",
        "reply": {"kind": "stream", "key": "out:raw"},
        "prompt": "The quick brown fox",
    }
    data.update(overrides)
    return msgpack.packb(data)


async def test_a_producer_writing_logit_bias_with_integer_keys_is_served(tiny, redis_url, redis_client):
    async with running_worker(worker_config(redis_url, "w1"), tiny):
        await redis_client.xadd(
            STREAM, {"msg": _raw_request(sampling={"max_tokens": 4, "temperature": 0, "logit_bias": {5: 100}})}
        )
        events = await final_events(redis_client, "out:raw")
    assert events[-1]["type"] == "done" and streamed_tokens(events) == [5, 5, 5, 5]


async def test_an_oversize_request_is_answered_where_it_asked(tiny, redis_url, redis_client):
    async with running_worker(worker_config(redis_url, "w1"), tiny):
        await redis_client.xadd(STREAM, {"msg": _raw_request(prompt="x" * (protocol.MAX_MESSAGE_BYTES + 10))})
        [event] = await final_events(redis_client, "out:raw")
        await wait_for(lambda: _nothing_pending(redis_client), what="the entry acknowledged")
    assert (event["type"], event["code"], event["id"]) == ("error", "too_large", "raw")
    assert await _dead_letter_codes(redis_client) == [b"too_large"]


@pytest.mark.parametrize(
    "fields",
    [
        {"msg": b"\x93\x01\x02"},
        {"msg": b"\xc1 not msgpack"},
        {"other": b"no msg field"},
        {"msg": msgpack.packb({"v": 1})},
    ],
    ids=["not-a-map", "garbage", "no-msg-field", "missing-fields"],
)
async def test_poison_without_a_reply_address_is_dead_lettered_and_acknowledged(tiny, redis_url, redis_client, fields):
    async with running_worker(worker_config(redis_url, "w1"), tiny):
        await redis_client.xadd(STREAM, fields)
        await wait_for(lambda: _dead_letter_codes(redis_client), what="the dead letter")
        await wait_for(lambda: _nothing_pending(redis_client), what="the entry acknowledged")
        await enqueue(redis_client, chat_request("next"))
        assert (await final_events(redis_client, "out:next"))[-1]["type"] == "done"
    assert await redis_client.xlen(STREAM) == 0


async def test_a_reply_key_in_lmqs_namespace_is_refused_and_nothing_is_written_there(tiny, redis_url, redis_client):
    """A producer's reply.key pointed at the request stream: the entry is dead-lettered, the stream gets no event and no TTL."""
    async with running_worker(worker_config(redis_url, "w1"), tiny):
        await redis_client.xadd(STREAM, {"msg": _raw_request(id="evil", reply={"kind": "stream", "key": STREAM})})
        await redis_client.xadd(STREAM, {"msg": _raw_request(id="fine", sampling={"max_tokens": 4})})
        events = await final_events(redis_client, "out:raw")
        assert events[-1]["type"] == "done", events[-1]["message"]
        await wait_for(lambda: _nothing_pending(redis_client), what="both entries acknowledged")
    assert await _dead_letter_codes(redis_client) == [b"reply_denied"]
    assert await redis_client.ttl(STREAM) == -1
    assert await redis_client.xlen(STREAM) == 0


async def test_an_entry_far_over_the_limit_is_refused_unread_and_dead_lettered_as_a_prefix(
    tiny, redis_url, redis_client, monkeypatch
):
    """16 MiB of prompt ids: the worker answers `too_large` where the entry asked without unpacking the
    entry (no msgpack decode of it at all) and keeps only a bounded prefix of it in the dead letter."""
    sizes = []
    real = msgpack.unpackb
    monkeypatch.setattr(
        msgpack, "unpackb", lambda data, *args, **kwargs: sizes.append(len(data)) or real(data, *args, **kwargs)
    )
    raw = _raw_request(prompt=None, prompt_ids=list(range(1 << 16, (1 << 16) + (4 << 20))))
    assert len(raw) > 16 << 20
    async with running_worker(worker_config(redis_url, "w1"), tiny):
        await redis_client.xadd(STREAM, {"msg": raw})
        [event] = await final_events(redis_client, "out:raw")
        await wait_for(lambda: _nothing_pending(redis_client), what="the entry acknowledged")
    assert (event["type"], event["code"], event["id"]) == ("error", "too_large", "raw")
    [(_, fields)] = await redis_client.xrange(DEAD_LETTER_STREAM)
    assert (
        fields[b"code"] == b"too_large" and fields[b"msg"] == raw[: len(fields[b"msg"])] and len(fields[b"msg"]) <= 4096
    )
    assert max(sizes, default=0) <= protocol.MAX_MESSAGE_BYTES
