"""What a Responses request becomes on the queue, and how a worker's answer and errors come back:
a real gateway and Redis, a scripted worker (the exact protocol request is visible), the openai SDK."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import openai
import pytest
import redis.asyncio as aioredis

import protocol
from gateway.auth import key_digest
from gateway.openai import REASONING_BUDGETS
from gateway.responses import background
from protocol.codec import encode
from protocol.keys import rate_limit_key
from tests.support.batch_files import poll
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

SHARE_A = rate_limit_key(key_digest("key-a"), "queued")
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture
async def redis(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_items_tools_and_a_named_call_on_the_queue_and_back(redis_url, redis):
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Rome is sunny."}]},
        {"role": "user", "content": "And Paris?"},
    ]
    async with (
        worker_running(redis, words_script(['{"city": ', '"Paris"}'])) as received,
        running_gateway(redis_url) as url,
    ):
        client = sdk(url)
        response = await client.responses.create(
            model=MODEL, instructions="Be brief.", input=history, tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=20, temperature=0,
        )  # fmt: skip
        newest = await client.responses.input_items.list(response.id, limit=2)
        oldest = [item async for item in client.responses.input_items.list(response.id, order="asc", limit=2)]
    [request] = received
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Rome is sunny."},
        {"role": "user", "content": "And Paris?"},
    ]
    assert request.tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["parameters"]}}
    ]
    assert request.constraint == {"type": "json_schema", "schema": WEATHER["parameters"]}
    assert request.sampling.max_tokens == 20 and request.sampling.temperature == 0
    [call] = response.output
    assert call.type == "function_call" and call.arguments == '{"city": "Paris"}' and call.status == "completed"
    assert response.tool_choice.name == "get_weather" and response.tools[0].name == "get_weather"
    assert [item.type for item in newest.data] == ["message", "message"] and newest.has_more
    assert newest.data[0].content[0].text == "And Paris?" and newest.data[1].content[0].type == "output_text"
    assert [item.type for item in oldest] == ["message", "function_call", "function_call_output", "message", "message"]
    assert oldest[0].content[0].type == "input_text" and oldest[1].call_id == "call_1"
    assert len({item.id for item in oldest}) == 5  # the SDK paged through them all by `after`


async def test_a_worker_error_mid_stream_fails_the_response_and_a_refusal_is_a_400(redis_url, redis):
    def script(request: protocol.Request) -> list[list[dict]]:
        if request.messages[-1]["content"] == "refuse":
            return [[protocol.error_event(request.id, 0, "prompt_too_long", "the prompt is too long")]]
        return [
            [protocol.started_event(request.id, 0, 5), protocol.delta_event(request.id, 1, "Hel", [1], 0)],
            [protocol.error_event(request.id, 2, "internal", "the worker failed")],
        ]

    async with worker_running(redis, script), running_gateway(redis_url) as url:
        client = sdk(url)
        async with client.responses.stream(model=MODEL, input="go") as stream:
            events = [event async for event in stream]
        assert [event.type for event in events][-3:] == [
            "response.content_part.done", "response.output_item.done", "response.failed"
        ]  # fmt: skip
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.message == "the worker failed"
        assert failed.output[0].content[0].text == "Hel" and failed.output[0].status == "incomplete"
        assert (await client.responses.retrieve(failed.id)).status == "failed"  # stored as it ended
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model=MODEL, input="refuse", stream=stream)
            assert "too long" in refused.value.message


# A Qwen3 answer as a worker streams it, a tag cut across deltas (as tests/gateway/test_reasoning.py).
PIECES = ["<think>", "\nThe user", " asks 2+2.", "\n</th", "ink>\n\n", "It is", " 4."]
REASONING, ANSWER, REASONING_TOKENS = "The user asks 2+2.", "It is 4.", 5


def thinking_events(request: protocol.Request) -> list[dict]:
    tags = {"start": "<think>", "end": "</think>", "open": False}
    events = [protocol.started_event(request.id, 0, 7, tags)]
    events += [protocol.delta_event(request.id, i + 1, piece, [100 + i], i) for i, piece in enumerate(PIECES)]
    return events + [protocol.done_event(request.id, len(PIECES) + 1, "stop", 7, len(PIECES), 0)]


@contextlib.asynccontextmanager
async def answering(redis: aioredis.Redis, answer) -> AsyncIterator[list[protocol.Request]]:
    """A scripted worker for the block that answers on each request's reply address: a pub/sub channel,
    or a background response's stream; `answer(request)` gives the events. Yields the requests taken."""
    received: list[protocol.Request] = []
    stop = asyncio.Event()

    async def serve() -> None:
        while taken := await take_request(redis, MODEL, "answering", stop):
            entry_id, request = taken
            received.append(request)
            for event in answer(request):
                if request.reply.kind == "stream":
                    await redis.xadd(request.reply.key, {"msg": encode(event)})
                else:
                    await publish(redis, request, [event])
            await finish(redis, request, entry_id)

    worker = asyncio.create_task(serve())
    await announce(redis, MODEL, "answering")
    try:
        yield received
    finally:
        stop.set()
        await worker


async def test_a_thinking_answer_is_a_reasoning_item_whole_streamed_and_in_the_background(redis_url, redis):
    async with answering(redis, thinking_events) as received, running_gateway(redis_url) as url:
        client = sdk(url)
        whole = await client.responses.create(model=MODEL, input="What is 2+2?", reasoning={"effort": "low"})
        async with client.responses.stream(model=MODEL, input="What is 2+2?") as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_response()
        queued = await client.responses.create(model=MODEL, input="What is 2+2?", background=True)
        background = await ended(client, queued.id)
    for response in (whole, streamed, background):
        reasoning, message = response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
        assert message.type == "message" and response.output_text == ANSWER
        assert response.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS
    assert kinds.count("response.reasoning_text.delta") >= 1 and "response.reasoning_text.done" in kinds
    assert whole.reasoning.effort == "low" and received[0].reasoning_budget == REASONING_BUDGETS["low"]
    assert received[1].reasoning_budget is None and received[2].reply.kind == "stream"


async def ended(client: openai.AsyncOpenAI, response_id: str, status: str = "completed"):
    async def found():
        response = await client.responses.retrieve(response_id)
        return response if response.status == status else None

    return await poll(found, what=f"background response {response_id} {status}")


def answer_events(request: protocol.Request) -> list[dict]:
    return [
        protocol.started_event(request.id, 0, 5),
        protocol.delta_event(request.id, 1, "ok", [7], 0),
        protocol.done_event(request.id, 2, "stop", 5, 1, 0),
    ]


async def test_background_responses_wait_for_room_in_their_keys_queue_share(redis_url, redis):
    """A key's background responses take places in its share of the queue (gateway/queue_share.py) as
    its live requests do: past the share they wait, queued (not refused: a batch item waits for its
    key's budget the same way), and go in as a worker's pickups free places."""
    await announce(redis)  # served, but nobody reads the stream yet
    async with running_gateway(redis_url, api_keys="key-a", max_queue_per_key=2) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="key-a", max_retries=0)
        queued = [await client.responses.create(model=MODEL, input=f"Say {i}.", background=True) for i in range(3)]
        assert [response.status for response in queued] == ["queued"] * 3
        await asyncio.sleep(1.5)  # a few of its driver's ticks: the third stays out of the queue
        assert await redis.xlen(protocol.request_stream(MODEL)) == 2
        assert await redis.zcard(SHARE_A) == 2
        with pytest.raises(openai.RateLimitError):  # the share is the key's, live and background alike
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        async with answering(redis, answer_events) as received:
            done = [await ended(client, response.id) for response in queued]
    assert [response.output_text for response in done] == ["ok"] * 3 and len(received) == 3
    assert await redis.zcard(SHARE_A) == 0  # each place freed when its worker started


async def _driver_blocked_reading(redis: aioredis.Redis) -> bool:
    """A client blocked in XREAD: the background driver, waiting on its response's reply stream."""
    clients = await redis.client_list()
    return any(client.get("cmd") == "xread" and "b" in client.get("flags", "") for client in clients)


async def test_a_delete_wins_over_the_background_driver_no_save_makes_the_record_again(redis_url, redis, monkeypatch):
    """The driver checked the record, then reads the worker's `started` after a DELETE: what it writes
    for that event (the in-progress object, the stream events) must not make the response again, an
    ownerless record and an event stream that nothing expires."""
    monkeypatch.setattr(background, "READ_BLOCK_MS", 60_000)  # the driver waits in its read until the event
    await announce(redis)
    async with running_gateway(redis_url) as url:
        client = sdk(url)
        response = await client.responses.create(model=MODEL, input="Say hi.", background=True)
        _, request = await take_request(redis)
        await poll(lambda: _driver_blocked_reading(redis), what="the driver reading the reply stream")
        await client.responses.delete(response.id)
        await redis.xadd(request.reply.key, {"msg": encode(protocol.started_event(request.id, 0, 5))})

        async def driver_gone():
            return not await redis.exists(f"lmq:response:{response.id}:lease")

        await poll(driver_gone, what="the driver to stop")
        left = [key for key in ("", ":events") if await redis.exists(f"lmq:response:{response.id}{key}")]
    assert not left, f"keys of the deleted response made again: {left}"
