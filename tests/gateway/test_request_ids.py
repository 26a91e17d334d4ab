"""Client-chosen request ids (X-Request-Id): namespaced per API key, a reuse while running is a 409,
and a request's cancellation carries a token only its gateway knows.

A scripted worker (gateway_support.py) plays the worker's part over the real Redis, so each test
decides when the requests it took are answered.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

import aiohttp
import pytest

import protocol
from gateway.choices import Choices, choice_requests
from gateway.config import GatewayConfig
from gateway.replies import AlreadyOpen, ReplyRouter
from gateway.sharded_replies import ShardedReplyRouter
from protocol.keys import sharded
from tests.support.gateway_harness import MODEL, announce, finish, publish, running_gateway, take_request, words_script

WAIT_S = 60.0
KEYS = "key-a,key-b"


@pytest.fixture
async def gateway_url(redis_url):
    async with running_gateway(redis_url, api_keys=KEYS, pickup_timeout=WAIT_S, keepalive_seconds=3600.0) as url:
        yield url


def chat(key: str, request_id: str, n: int = 1, content: str = "hi") -> dict:
    return {
        "json": {"model": MODEL, "messages": [{"role": "user", "content": content}], "n": n},
        "headers": {"Authorization": f"Bearer {key}", "X-Request-Id": request_id},
    }


async def post(http: aiohttp.ClientSession, url: str, call: dict) -> tuple[int, Any, dict]:
    async with http.post(url + "/v1/chat/completions", **call) as response:
        return response.status, response.headers.copy(), await response.json()


async def take(redis_client, count: int) -> list[tuple[str, protocol.Request]]:
    return [await asyncio.wait_for(take_request(redis_client), WAIT_S) for _ in range(count)]  # type: ignore[misc]


async def answer(redis_client, taken: list[tuple[str, protocol.Request]], word: str) -> None:
    for entry_id, request in taken:
        for batch in words_script([word])(request):
            await publish(redis_client, request, batch)
        await finish(redis_client, request, entry_id)


async def test_a_reused_id_with_n_2_is_a_409_and_the_running_request_keeps_its_answer(gateway_url, redis_client):
    await announce(redis_client)
    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(post(http, gateway_url, chat("key-a", "job-77", n=2, content="a long prompt")))
        taken = await take(redis_client, 2)
        status, _, body = await asyncio.wait_for(post(http, gateway_url, chat("key-a", "job-77", n=2)), WAIT_S)
        assert status == 409, body
        assert body["error"]["code"] == "duplicate_id"
        await answer(redis_client, taken, "mine")
        status, headers, body = await asyncio.wait_for(first, WAIT_S)
    assert status == 200
    assert [choice["message"]["content"] for choice in body["choices"]] == ["mine", "mine"]
    assert headers["X-Request-Id"] == body["id"] == "job-77"
    assert await redis_client.xlen(protocol.request_stream(MODEL)) == 0  # the refused one enqueued nothing


async def test_a_reuse_that_meets_a_running_choice_id_is_a_409(gateway_url, redis_client):
    """`job-1` with n=2 runs as `job-1-0` and `job-1-1`: a request `job-1-1` meets one of them, and a
    request `job-1` with n=2 meets a running `job-1-1`. Every choice id is checked."""
    await announce(redis_client)
    async with aiohttp.ClientSession() as http:
        single = asyncio.create_task(post(http, gateway_url, chat("key-a", "job-1-1")))
        taken = await take(redis_client, 1)
        status, _, body = await asyncio.wait_for(post(http, gateway_url, chat("key-a", "job-1", n=2)), WAIT_S)
        assert status == 409, body
        await answer(redis_client, taken, "single")
        status, _, body = await asyncio.wait_for(single, WAIT_S)
    assert status == 200 and body["choices"][0]["message"]["content"] == "single"


async def test_two_keys_may_run_the_same_id_at_once_and_each_gets_its_own_answer(gateway_url, redis_client):
    await announce(redis_client)
    async with aiohttp.ClientSession() as http:
        a = asyncio.create_task(post(http, gateway_url, chat("key-a", "job-77", n=2)))
        taken_a = await take(redis_client, 2)
        b = asyncio.create_task(post(http, gateway_url, chat("key-b", "job-77", n=2)))
        taken_b = await take(redis_client, 2)
        ids = [request.id for _, request in taken_a + taken_b]
        assert len(set(ids)) == 4, ids
        assert all(request_id.endswith(("job-77-0", "job-77-1")) for request_id in ids)
        await answer(redis_client, taken_b, "bee")
        await answer(redis_client, taken_a, "ay")
        (status_a, _, body_a), (status_b, _, body_b) = await asyncio.wait_for(asyncio.gather(a, b), WAIT_S)
    assert status_a == status_b == 200
    assert [choice["message"]["content"] for choice in body_a["choices"]] == ["ay", "ay"]
    assert [choice["message"]["content"] for choice in body_b["choices"]] == ["bee", "bee"]
    assert body_a["id"] == body_b["id"] == "job-77"


async def test_a_long_client_id_still_fits_the_protocol_with_its_choices(gateway_url, redis_client):
    await announce(redis_client)
    client_id = "x" * 128
    async with aiohttp.ClientSession() as http:
        call = asyncio.create_task(post(http, gateway_url, chat("key-a", client_id, n=2)))
        taken = await take(redis_client, 2)
        assert all(len(request.id) <= protocol.messages.MAX_ID_LENGTH for _, request in taken)
        assert len({request.id for _, request in taken}) == 2
        await answer(redis_client, taken, "ok")
        status, headers, _ = await asyncio.wait_for(call, WAIT_S)
    assert status == 200 and headers["X-Request-Id"] == client_id


async def test_the_gateways_cancel_carries_the_token_its_request_names(gateway_url, redis_client):
    await announce(redis_client)
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(protocol.CANCEL_CHANNEL)
    body = {**chat("key-a", "order-42")["json"], "stream": True}
    async with aiohttp.ClientSession() as http:
        # The headers come once a worker admits the request (or after admission_wait): answer it meanwhile.
        headers = chat("key-a", "order-42")["headers"]
        posted = asyncio.create_task(http.post(gateway_url + "/v1/chat/completions", json=body, headers=headers))
        [(entry_id, request)] = await take(redis_client, 1)
        await publish(redis_client, request, [protocol.delta_event(request.id, 0, "Hi", [1], 0)])
        async with await posted as response:
            async for line in response.content:
                if b'"Hi"' in line:
                    break
    message = None
    for seq in range(1, 3000):  # the gateway sees the client gone when it next writes
        await publish(redis_client, request, [protocol.delta_event(request.id, seq, "x", [2], seq)])
        message = await pubsub.get_message(timeout=0.02)
        if message is not None:
            break
    await pubsub.aclose()
    assert message is not None, "no cancellation was published"
    cancel = protocol.decode_cancel(message["data"])
    assert cancel.id == request.id and request.id.endswith(":order-42")
    assert request.cancel_digest is not None and cancel.digest == request.cancel_digest
    await finish(redis_client, request, entry_id)


def test_the_router_refuses_to_replace_an_open_queue():
    router = ReplyRouter(redis=None, channel="lmq:reply:test")  # type: ignore[arg-type]
    queue = router.open("job-77")
    with pytest.raises(AlreadyOpen):
        router.open("job-77")
    router._route(protocol.encode_event_batch([protocol.delta_event("job-77", 0, "a", [1], 0)]))
    assert queue.qsize() == 1  # the first queue still gets the request's events


def test_on_a_cluster_each_choice_replies_on_its_own_shards_channel():
    """A choice `<id>-<k>` lives in the shard its own id hashes to, and a worker refuses an `spubsub`
    reply outside the entry's shard: each choice must name its own shard's channel."""
    shards = sharded(12)
    router = ShardedReplyRouter(redis=None, shards=shards, gateway_id="g1")  # type: ignore[arg-type]
    gateway = types.SimpleNamespace(replies=router, metrics=_NoMetrics(), config=GatewayConfig())
    base = protocol.Request(
        id="job-77",
        model=MODEL,
        reply=router.reply_for("job-77"),
        sampling=protocol.SamplingParams(),
        deadline=2e9,
        prompt="hi",
    )
    choices = Choices(gateway, choice_requests([base], 8), "chat")  # type: ignore[arg-type]
    for generation in choices.generations:
        shard = shards.for_request(generation.request.id)
        assert generation.request.reply == protocol.Reply("spubsub", shard.key("reply:g1"))
        assert shard.holds(generation.request.reply.key)
        generation.span.end()


class _NoMetrics:
    def request(self, *args):
        return None


def test_a_request_whose_reader_left_too_many_events_unread_is_ended_and_its_queue_emptied(monkeypatch):
    """What a client that stopped reading costs is bounded in events, not only in time (sse.py's write
    timeout): past MAX_PENDING_EVENTS its queue is emptied, holds one error, and takes no more."""
    from gateway import replies

    monkeypatch.setattr(replies, "MAX_PENDING_EVENTS", 8)
    router = ReplyRouter(redis=None, channel="lmq:reply:test")  # type: ignore[arg-type]
    slow, other = router.open("slow"), router.open("other")
    for offset in range(12):
        batch = [
            protocol.delta_event("slow", offset, "a", [1], offset),
            protocol.delta_event("other", offset, "b", [2], offset),
        ]
        router._route(protocol.encode_event_batch(batch))
        other.get_nowait()  # this reader keeps up
    assert slow.qsize() == 1 and slow.get_nowait()["type"] == "error"
    assert not router.is_open("slow") and router.is_open("other")
