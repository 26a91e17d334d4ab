"""A real worker (the tiny model) answers `lmq:resume` (protocol/resume.py) over a real Redis.

The fault is played by hand: a promoted replica that missed the old primary's last writes is a
Redis whose last reply-stream entries, holder key and progress record are deleted and whose entry
is pending for nobody. The resume must bring all of that back, send again exactly the events after
the consumer's last one, then `resumed`; and it must be ignored without the request's token.

What the consumer takes is judged by the consumer's own rule (gateway/resume.py, `Resumption`): a
worker that goes on streaming writes new events after the lost ones and before what it sends
again, and a consumer takes those only once the gap before them is filled.
"""

from __future__ import annotations

import dataclasses

import pytest
import redis.asyncio as aioredis

import protocol
from gateway.resume import Resumption
from protocol import REQUEST_GROUP
from protocol.resume import RESUME_CHANNEL, resume_message
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
from worker import resume

TOKEN, OTHER = "t" * 32, "o" * 32
STREAM = protocol.request_stream("tiny")


@pytest.fixture
async def client(any_redis_url):
    redis = aioredis.Redis.from_url(any_redis_url)
    yield redis
    await redis.aclose()


def owned(request_id: str, **fields) -> protocol.Request:
    return dataclasses.replace(chat_request(request_id, **fields), cancel_digest=protocol.cancel_digest(TOKEN))


async def _lose_the_last(redis, key: str, count: int) -> list[dict]:
    """Delete the reply stream's last `count` entries (writes the promoted replica never got); the events kept."""
    entries = await redis.xrange(key)
    await redis.xdel(key, *[entry_id for entry_id, _ in entries[-count:]])
    return [protocol.decode_event(fields[b"msg"]) for _, fields in entries[:-count]]


def _relayed(events: list[dict], have: list[dict]) -> list[dict]:
    """What a consumer that had `have` (a prefix of `events`) when it asked takes of the rest: until
    `resumed`, each event in order and leaving no hole (the resume rule); then each new `seq` once."""
    taken, resuming = list(have), True
    for event in events[len(have) :]:
        last, relayed = taken[-1]["seq"], len(streamed_tokens(taken))
        if event["type"] == "resumed":
            resuming = False
        elif event["seq"] > last and (not resuming or Resumption.in_order(event, last, relayed)):
            taken.append(event)
    return taken


async def test_a_resume_re_establishes_the_request_and_sends_again_what_followed(tiny, any_redis_url, client):
    reference = await _undisturbed(tiny, any_redis_url, client, max_tokens=40)
    slow = dataclasses.replace(tiny, model=SlowModel(tiny.model, step_seconds=0.05))
    async with running_worker(worker_config(any_redis_url, "w1"), slow):
        request = owned("job-1", max_tokens=40)
        entry_id = await enqueue(client, request)
        await wait_for(lambda: _deltas(client, "out:job-1", 6), what="six deltas")
        kept = await _lose_the_last(client, "out:job-1", 3)
        newest = (await reply_events(client, "out:job-1"))[-1]["seq"]
        await wait_for(lambda: _sent_after(client, "out:job-1", newest), what="a delta written after the lost ones")
        await client.delete(protocol.holder_key("job-1"), protocol.progress_key("job-1"))
        await client.xack(STREAM, REQUEST_GROUP, entry_id)  # pending for nobody
        have = streamed_tokens(kept)
        await client.publish(RESUME_CHANNEL, resume_message("job-1", kept[-1]["seq"], len(have), TOKEN))
        resumed = await wait_for(lambda: _resumed(client, "out:job-1"), what="a resumed event")
        pending = await client.xpending_range(STREAM, REQUEST_GROUP, min=entry_id, max=entry_id, count=1)
        holder = await client.get(protocol.holder_key("job-1"))
        progress = protocol.decode_progress(await client.get(protocol.progress_key("job-1")))
        events = await final_events(client, "out:job-1")
    assert [p["consumer"] for p in pending] == [b"w1"] and holder == entry_id.encode()
    assert resumed["offset"] >= len(have) and len(progress) >= len(have) and progress == reference[: len(progress)]
    relayed = _relayed(events, kept)
    assert relayed[-1]["type"] == "done" and streamed_tokens(relayed) == reference
    assert not await client.xpending_range(STREAM, REQUEST_GROUP, min="-", max="+", count=10)


async def test_an_ended_request_is_resumed_with_its_done(tiny, any_redis_url, client):
    reference = await _undisturbed(tiny, any_redis_url, client)
    async with running_worker(worker_config(any_redis_url, "w1"), tiny):
        await enqueue(client, owned("job-2", max_tokens=24))
        await final_events(client, "out:job-2")
        kept = await _lose_the_last(client, "out:job-2", 2)  # the last delta and the done
        await client.publish(
            RESUME_CHANNEL, resume_message("job-2", kept[-1]["seq"], len(streamed_tokens(kept)), TOKEN)
        )
        await wait_for(lambda: _resumed(client, "out:job-2"), what="a resumed event")
        events = await reply_events(client, "out:job-2")
    assert events[-1]["type"] == "resumed" and events[-2]["type"] == "done"
    relayed = _relayed(events, kept)
    assert relayed[-1]["type"] == "done" and streamed_tokens(relayed) == reference


async def test_a_resume_without_the_requests_token_is_ignored(tiny, any_redis_url, client):
    async with running_worker(worker_config(any_redis_url, "w1"), tiny):
        await enqueue(client, owned("job-3", max_tokens=8))
        await final_events(client, "out:job-3")
        await client.publish(RESUME_CHANNEL, resume_message("job-3", -1, 0, OTHER))
        await client.publish(RESUME_CHANNEL, resume_message("job-3", -1, 0))
        await client.publish(RESUME_CHANNEL, resume_message("job-3", 100, 8, TOKEN))  # the owner's: answered
        await wait_for(lambda: _resumed(client, "out:job-3"), what="the owner's resume answered")
        events = await reply_events(client, "out:job-3")
    assert [event["type"] for event in events].count("resumed") == 1
    assert sum(1 for event in events if event["type"] == "done") == 1  # the owner had everything: nothing sent again


async def _undisturbed(tiny, redis_url, client, max_tokens: int = 24) -> list[int]:
    async with running_worker(worker_config(redis_url, "w0"), tiny):
        await enqueue(client, chat_request("reference", max_tokens=max_tokens))
        return streamed_tokens(await final_events(client, "out:reference"))


async def _deltas(redis, key: str, count: int) -> bool:
    return sum(1 for event in await reply_events(redis, key) if event["type"] == "delta") >= count


async def _sent_after(redis, key: str, seq: int) -> bool:
    return (await reply_events(redis, key))[-1]["seq"] > seq


async def _resumed(redis, key: str) -> dict | None:
    return next((event for event in await reply_events(redis, key) if event["type"] == "resumed"), None)


def test_what_a_worker_keeps_is_bounded_and_a_gap_it_no_longer_holds_is_refused(monkeypatch):
    monkeypatch.setattr(resume, "MAX_KEPT_BYTES", 2_000)
    sent = resume.SentEvents()
    request = owned("long")
    sent.started(request, "1-0", [7, 7])  # taken over after 2 streamed tokens
    for seq in range(1, 201):
        sent.sent("1-0", protocol.delta_event("long", seq, "word ", [seq], 2 + seq - 1))
    kept = sent.get("long")
    assert kept.size <= 2_000 and sent.total == kept.size and len(kept.tokens) == 202
    first_kept = kept.events[0][0]
    assert kept.dropped_seq == first_kept - 1 and kept.first_offset == 2 + first_kept - 1
    sent.ended("1-0")
    monkeypatch.setattr(resume, "KEEP_ENDED_S", -1.0)  # an ended request is forgotten once its time is up
    assert sent.get("long") is None and sent.total == 0


async def test_a_resume_the_worker_can_no_longer_fill_gets_an_unavailable_error(
    tiny, any_redis_url, client, monkeypatch
):
    monkeypatch.setattr(resume, "MAX_KEPT_BYTES", 1_000)  # a few events: the first ones are dropped
    async with running_worker(worker_config(any_redis_url, "w1"), tiny):
        await enqueue(client, owned("job-4", max_tokens=24))
        await final_events(client, "out:job-4")
        await client.publish(RESUME_CHANNEL, resume_message("job-4", 1, 1, TOKEN))
        await wait_for(lambda: _last_is(client, "out:job-4", "error"), what="an error after the done")
        events = await reply_events(client, "out:job-4")
    assert events[-1]["type"] == "error" and events[-1]["code"] == "unavailable", events[-1]
    assert not [event for event in events if event["type"] == "resumed"]


async def _last_is(redis, key: str, kind: str) -> bool:
    events = await reply_events(redis, key)
    return bool(events) and events[-1]["type"] == kind
