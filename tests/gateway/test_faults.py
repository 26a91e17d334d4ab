"""What the gateway does when the path from a worker breaks: never relay an answer with a hole in
it, never fail a request on a stale connection, recreate a lost consumer group, and tell a busy
worker from a missing one. A scripted worker plays the protocol over the real Redis."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

import protocol
from protocol.redis_client import connect
from protocol.resume import RESUME_CHANNEL, decode_resume, resumed_event
from tests.support.gateway_harness import (
    MODEL,
    announce,
    finish,
    publish,
    running_gateway,
    take_request,
    words_script,
    worker_running,
)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def gateway_url(redis_url):
    async with running_gateway(redis_url, pickup_timeout=1.0, request_timeout=20.0) as url:
        yield url


async def _post(url: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=body) as response:
            return response.status, await response.text()


async def _serve_one(redis, events_of) -> None:
    """Take one request and publish the batches `events_of(request)` gives."""
    entry_id, request = await asyncio.wait_for(take_request(redis), 10)
    for batch in events_of(request):
        await publish(redis, request, batch)
    await finish(redis, request, entry_id)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_gap_in_the_offsets_is_an_error_never_a_shorter_answer(gateway_url, redis_client, stream):
    def with_a_hole(request):
        return [
            [protocol.delta_event(request.id, 0, "Hello", [1], 0)],
            [protocol.delta_event(request.id, 2, " Zebra", [3], 2)],  # offset 1 never arrived
            [protocol.done_event(request.id, 3, "length", 5, 3, 0)],
        ]

    await announce(redis_client)
    worker = asyncio.create_task(_serve_one(redis_client, with_a_hole))
    status, body = await _post(gateway_url, {**CHAT, "stream": stream})
    await worker
    if stream:
        assert status == 200 and "lost on the way" in body and "Zebra" not in body, body
    else:
        assert status == 503 and "lost on the way" in body


async def test_a_done_counting_more_tokens_than_arrived_is_an_error(gateway_url, redis_client):
    def lost_tail(request):
        return [
            [protocol.delta_event(request.id, 0, "Hello", [1], 0)],
            [protocol.done_event(request.id, 2, "length", 5, 2, 0)],
        ]

    await announce(redis_client)
    worker = asyncio.create_task(_serve_one(redis_client, lost_tail))
    status, body = await _post(gateway_url, CHAT)
    await worker
    assert status == 503 and "1 tokens of the answer were lost" in body


async def _break_the_subscription_mid_answer(redis, request_holder: list, answer_resume) -> None:
    """Serve one request: "Hello", then the gateway's subscription drops and " world" goes unheard;
    `answer_resume(request, resume)` plays the worker's side of the resume that follows."""
    entry_id, request = await asyncio.wait_for(take_request(redis), 10)
    request_holder.append(request)
    await publish(
        redis, request, [protocol.started_event(request.id, 0, 5), protocol.delta_event(request.id, 1, "Hello", [1], 0)]
    )
    await asyncio.sleep(0.3)
    await redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")  # the gateway's subscription drops (ours too)
    await publish(redis, request, [protocol.delta_event(request.id, 2, " world", [2], 1)])  # unheard
    resumes = redis.pubsub()  # after the kill: the gateway asks again until it is answered
    await resumes.subscribe(RESUME_CHANNEL)
    async with asyncio.timeout(10):
        while (message := await resumes.get_message(timeout=1)) is None or message["type"] != "message":
            pass
    await answer_resume(request, decode_resume(message["data"]))
    await resumes.aclose()
    await finish(redis, request, entry_id)


async def test_a_broken_reply_subscription_is_resumed_from_the_worker(gateway_url, redis_client):
    """The gateway asks for what it missed (the last seq and offset it has, its cancel token) and
    relays what comes in order: the client sees the whole answer, once, and nothing of the fault."""
    asked = []

    async def send_again(request, resume):
        asked.append(resume)
        delta = protocol.delta_event(request.id, 2, " world", [2], 1)
        await publish(
            redis_client, request, [protocol.delta_event(request.id, 3, "!", [3], 2)]
        )  # new, before the replay
        await publish(
            redis_client,
            request,
            [delta, protocol.delta_event(request.id, 3, "!", [3], 2), resumed_event(request.id, 3, 3)],
        )
        await publish(redis_client, request, [protocol.done_event(request.id, 4, "length", 5, 3, 0)])

    await announce(redis_client)
    requests: list = []
    worker = asyncio.create_task(_break_the_subscription_mid_answer(redis_client, requests, send_again))
    status, body = await _post(gateway_url, {**CHAT, "stream": True})
    await worker
    assert status == 200 and "[DONE]" in body and "error" not in body, body
    text = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in body.splitlines()
        if line.startswith("data: {") and json.loads(line[6:]).get("choices")
    )
    assert text == "Hello world!", body
    (request,) = requests
    assert (asked[0].id, asked[0].seq, asked[0].offset) == (request.id, 1, 1)
    assert asked[0].digest == request.cancel_digest  # only this gateway's token makes a worker send again


async def test_a_broken_reply_subscription_no_worker_answers_the_resume_the_request_fails_visibly(
    redis_url, redis_client
):
    """Events published while the subscription was away are gone and nobody sends them again: the
    request must not just go on. It ends with an error once `resume_timeout` has passed."""

    async def ignore(request, resume):
        await publish(redis_client, request, [protocol.done_event(request.id, 3, "length", 5, 2, 0)])  # a hole: dropped

    await announce(redis_client)
    async with running_gateway(redis_url, pickup_timeout=1.0, request_timeout=20.0, resume_timeout=1.5) as gateway:
        worker = asyncio.create_task(_break_the_subscription_mid_answer(redis_client, [], ignore))
        status, body = await _post(gateway, {**CHAT, "stream": True})
        await worker
        assert status == 200 and "Hello" in body and "answer may be lost" in body and "[DONE]" not in body
        async with worker_running(redis_client, words_script(["fine"])):  # and the next request is served normally
            assert (await _post(gateway, CHAT))[0] == 200


async def test_not_ready_until_the_reply_subscription_is_back(fresh_redis_server):
    """After Redis comes back (a restart, a Sentinel failover) the reply subscription reconnects a
    moment later; a request taken meanwhile would end in "answer may be lost". /ready stays 503
    until it is back, so whoever waits for /ready gets answers."""
    server = fresh_redis_server(appendonly=True)
    redis = connect(server.url)

    async def ready(url: str) -> bool:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/ready") as response:
                return response.status == 200

    try:
        async with running_gateway(server.url, pickup_timeout=5.0) as url:
            await announce(redis)
            assert await ready(url)
            server.kill()
            await asyncio.sleep(1.0)  # the subscription broke; its reconnections fail
            server.start()
            while not await ready(url):
                await asyncio.sleep(0.02)
            async with worker_running(redis, words_script(["back"])):
                status, body = await _post(url, CHAT)
            assert status == 200 and "back" in body, body
    finally:
        await redis.aclose()


async def test_a_worker_that_holds_the_request_is_not_mistaken_for_none(gateway_url, redis_client):
    """pickup_timeout is for requests nobody read; one a busy worker read waits for its first token."""

    async def busy_worker():
        entry_id, request = await asyncio.wait_for(take_request(redis_client), 10)
        await asyncio.sleep(2.5)  # prefilling other prompts, longer than pickup_timeout (1 s)
        for batch in words_script(["late", " but", " whole"])(request):
            await publish(redis_client, request, batch)
        await finish(redis_client, request, entry_id)

    await announce(redis_client)
    worker = asyncio.create_task(busy_worker())
    status, body = await _post(gateway_url, CHAT)
    await worker
    assert status == 200 and "late but whole" in body


async def test_a_request_nobody_reads_still_times_out_at_pickup(gateway_url, redis_client):
    await announce(redis_client)
    status, body = await _post(gateway_url, CHAT)
    assert status == 504 and "no worker started the request" in body


async def test_a_lost_consumer_group_is_recreated_not_a_500(gateway_url, redis_client):
    async with worker_running(redis_client, words_script(["one"])):
        assert (await _post(gateway_url, CHAT))[0] == 200
    await redis_client.flushall()  # Redis lost its data: the stream and group are gone
    async with worker_running(redis_client, words_script(["two"])):
        status, body = await _post(gateway_url, CHAT)
    assert status == 200 and "two" in body


async def test_the_sdk_retries_a_lost_answer_and_gets_a_whole_one(gateway_url, redis_client):
    """503 is what the official SDKs retry: a request whose events were lost succeeds on the retry."""
    attempts = []

    def first_loses_a_token(request):
        attempts.append(request.id)
        if len(attempts) == 1:
            return [
                [protocol.delta_event(request.id, 1, " world", [2], 1)],
                [protocol.done_event(request.id, 2, "length", 5, 2, 0)],
            ]
        return words_script(["Hello", " world"], finish_reason="length")(request)

    async with worker_running(redis_client, first_loses_a_token):
        client = openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key="x", max_retries=2)
        answer = await client.chat.completions.create(**CHAT)
        await client.close()
    assert answer.choices[0].message.content == "Hello world" and len(attempts) == 2
