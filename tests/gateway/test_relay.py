"""The gateway's relay of worker events, driven by a scripted worker over the real Redis.

Each test plays the worker's part of the protocol itself, so the SSE shapes, the duplicate guard,
timeouts and cancellation are tested without a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import anthropic
import openai
import pytest

import protocol
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
from tests.support.worker_harness import wait_for

WORDS = ["Hello", ",", " world", "!"]


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each event in an SSE body."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = [line for line in block.split("\n") if not line.startswith(":")]
        if not lines:
            continue
        name = next((line[len("event: ") :] for line in lines if line.startswith("event: ")), None)
        data = "\n".join(line[len("data: ") :] for line in lines if line.startswith("data: "))
        events.append((name, data))
    return events


async def post_sse(url: str, body: dict) -> list[tuple[str | None, str]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            return parse_sse(await response.text())


WAIT_S = 60.0  # for what takes milliseconds on an idle machine; only a failing test waits this long


@pytest.fixture
async def gateway_url(redis_url):
    # Generous pickup time (the scripted worker picks a request up at once, however slowly), and no
    # keep-alive ping inside these short streams however long a busy machine pauses between events:
    # the tests check exact event sequences.
    async with running_gateway(redis_url, pickup_timeout=WAIT_S, keepalive_seconds=3600.0) as url:
        yield url


async def test_chat_stream_chunks_share_id_and_created_and_end_with_done(gateway_url, redis_client):
    async with worker_running(redis_client, words_script(WORDS)):
        events = await post_sse(
            gateway_url + "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert {chunk["id"] for chunk in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
    assert {chunk["created"] for chunk in chunks} == {chunks[0]["created"]}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks) == "".join(WORDS)
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert all("usage" not in chunk for chunk in chunks)  # never a usage chunk unless asked


async def test_chat_stream_with_include_usage_ends_with_a_usage_chunk(gateway_url, redis_client):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with worker_running(redis_client, words_script(WORDS, prompt_tokens=9, cached_tokens=4)):
        events = await post_sse(gateway_url + "/v1/chat/completions", body)
    chunks = [json.loads(data) for _, data in events[:-1]]
    *content, last = chunks
    assert all(chunk["usage"] is None for chunk in content)
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


async def test_legacy_completion_streams_text_chunks(gateway_url, redis_client):
    async with worker_running(redis_client, words_script(WORDS, finish_reason="length")) as received:
        events = await post_sse(
            gateway_url + "/v1/completions", {"model": MODEL, "prompt": [[5, 6, 7]], "stream": True, "max_tokens": 4}
        )
    assert received[0].prompt_ids == [5, 6, 7]
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "".join(WORDS)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_request_fields_reach_the_worker(gateway_url, redis_client):
    client = openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key="none", max_retries=0)
    async with worker_running(redis_client, words_script(WORDS)) as received:
        await client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            max_completion_tokens=12,
            temperature=0.5,
            top_p=0.9,
            seed=3,
            stop="END",
            presence_penalty=0.5,
            logit_bias={"17": -5},
            user="someone",
            extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
        )
    request = received[0]
    assert request.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (
        12,
        0.5,
        0.9,
        20,
        0.05,
    )
    assert (sampling.seed, sampling.stop, sampling.presence_penalty, sampling.repetition_penalty) == (
        3,
        ["END"],
        0.5,
        1.1,
    )
    assert sampling.logit_bias == {17: -5.0} and sampling.ignore_eos
    assert request.reply.kind == "pubsub" and request.reply.key.startswith("lmq:reply:")


async def test_openai_sdk_reads_a_whole_answer_with_usage(gateway_url, redis_client):
    client = openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key="none", max_retries=0)
    async with worker_running(redis_client, words_script(WORDS, prompt_tokens=9, cached_tokens=4)):
        completion = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert completion.choices[0].message.content == "".join(WORDS)
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.total_tokens == 13
    assert completion.usage.prompt_tokens_details.cached_tokens == 4


async def test_anthropic_stream_has_the_event_sequence(gateway_url, redis_client):
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stop_sequences": ["!"],
    }

    def stopped_by_sequence(request):
        *batches, _ = words_script(WORDS[:3])(request)
        return batches + [[protocol.done_event(request.id, 3, "stop", 7, 3, 2, stop_sequence="!")]]

    async with worker_running(redis_client, stopped_by_sequence) as received:
        events = await post_sse(gateway_url + "/v1/messages", body)
    assert received[0].sampling.stop == ["!"]
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]  # blocks open as their content comes
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    data = [json.loads(payload) for _, payload in events]
    assert all(item["type"] == name for (name, _), item in zip(events, data))
    assert data[0]["message"]["id"].startswith("msg_")
    assert "".join(item["delta"]["text"] for item in data[3:-3]) == "".join(WORDS[:3])
    assert data[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "!"}
    assert data[-2]["usage"] == {
        "input_tokens": 5,
        "output_tokens": 3,
        "cache_read_input_tokens": 2,
        "cache_creation_input_tokens": 0,
    }


async def test_anthropic_sdk_stream_and_message(gateway_url, redis_client):
    client = anthropic.AsyncAnthropic(base_url=gateway_url, api_key="none", max_retries=0)
    async with worker_running(redis_client, words_script(WORDS, finish_reason="length")) as received:
        async with client.messages.stream(
            model=MODEL, max_tokens=4, system="Be brief.", messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            texts = [text async for text in stream.text_stream]
            message = await stream.get_final_message()
        whole = await client.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            extra_body={"temperature": 0.2, "top_k": 5},
        )
    assert "".join(texts) == "".join(WORDS)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4 and message.usage.input_tokens == 7
    assert whole.content[0].text == "".join(WORDS) and whole.stop_reason == "max_tokens"
    assert received[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert (received[1].sampling.temperature, received[1].sampling.top_k) == (0.2, 5)


async def test_duplicate_deltas_after_a_worker_rerun_are_dropped(gateway_url, redis_client):
    def rerun(request):
        first = [protocol.delta_event(request.id, 0, "A", [1], 0), protocol.delta_event(request.id, 1, "B", [2], 1)]
        # a second worker re-ran the request and resent the token at offset 1 before continuing
        again = [protocol.delta_event(request.id, 0, "B", [2], 1), protocol.delta_event(request.id, 1, "C", [3], 2)]
        return [first, again, [protocol.done_event(request.id, 2, "stop", 3, 3, 0)]]

    client = openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key="none", max_retries=0)
    async with worker_running(redis_client, rerun):
        completion = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert completion.choices[0].message.content == "ABC"


@pytest.mark.parametrize("code, status", [("prompt_too_long", 400), ("timeout", 504), ("internal", 500)])
async def test_worker_errors_become_http_errors_in_each_shape(gateway_url, redis_client, code, status):
    def failing(request):
        return [[protocol.error_event(request.id, 0, code, "it went wrong")]]

    openai_client = openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key="none", max_retries=0)
    anthropic_client = anthropic.AsyncAnthropic(base_url=gateway_url, api_key="none", max_retries=0)
    async with worker_running(redis_client, failing):
        with pytest.raises(openai.APIStatusError) as openai_error:
            await openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(anthropic.APIStatusError) as anthropic_error:
            await anthropic_client.messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
        with pytest.raises(openai.APIError, match="it went wrong"):  # inside an open stream
            stream = await openai_client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            async for _ in stream:
                pass
        with pytest.raises(anthropic.APIStatusError, match="it went wrong"):
            async with anthropic_client.messages.stream(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            ) as stream:
                async for _ in stream:
                    pass
    assert openai_error.value.status_code == status and openai_error.value.body["code"] == code
    assert anthropic_error.value.status_code == status
    assert "it went wrong" in anthropic_error.value.message


async def test_a_request_no_worker_takes_times_out_and_leaves_the_stream(redis_url, redis_client):
    await announce(redis_client)
    async with running_gateway(redis_url, pickup_timeout=0.3) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as error:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert error.value.status_code == 504
    assert "no worker started the request" in error.value.message
    assert await redis_client.xlen(protocol.request_stream(MODEL)) == 0


@contextlib.asynccontextmanager
async def cancels_heard(redis_client) -> AsyncIterator[asyncio.Queue[str]]:
    """The request ids cancelled on lmq:cancel while the block runs."""
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(protocol.CANCEL_CHANNEL)
    ids: asyncio.Queue[str] = asyncio.Queue()

    async def listen():
        async for message in pubsub.listen():
            ids.put_nowait(protocol.decode_cancel(message["data"]).id)

    task = asyncio.create_task(listen())
    try:
        yield ids
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pubsub.aclose()


async def test_a_client_leaving_mid_stream_cancels_the_request(gateway_url, redis_client):
    await announce(redis_client)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with cancels_heard(redis_client) as cancelled, aiohttp.ClientSession() as http:
        # The headers come once a worker admits the request (or after admission_wait): answer it meanwhile.
        posted = asyncio.create_task(http.post(gateway_url + "/v1/chat/completions", json=body))
        entry_id, request = await take_request(redis_client)  # type: ignore[misc]
        await publish(redis_client, request, [protocol.delta_event(request.id, 0, "Hi", [1], 0)])
        async with await posted as response:
            async for line in response.content:
                if b'"Hi"' in line:
                    break
        # the client closed the connection; the worker keeps producing until it hears the cancel
        for seq in range(1, 100):
            await publish(redis_client, request, [protocol.delta_event(request.id, seq, "x", [2], seq)])
            if not cancelled.empty():
                break
            await asyncio.sleep(0.02)
        assert await asyncio.wait_for(cancelled.get(), WAIT_S) == request.id
    await finish(redis_client, request, entry_id)


async def test_a_client_leaving_while_waiting_withdraws_the_request(gateway_url, redis_client):
    await announce(redis_client)
    stream = protocol.request_stream(MODEL)
    async with cancels_heard(redis_client) as cancelled, aiohttp.ClientSession() as http:
        call = asyncio.create_task(
            http.post(
                gateway_url + "/v1/messages",
                json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            )
        )
        await wait_for(lambda: redis_client.xlen(stream), what="the request in the stream", timeout=WAIT_S)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        assert (await asyncio.wait_for(cancelled.get(), WAIT_S)).startswith("msg_")
    assert await redis_client.xlen(stream) == 0  # no worker will run it
