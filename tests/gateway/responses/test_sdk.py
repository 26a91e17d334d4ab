"""The Responses API through the official `openai` SDK, unmodified: a real gateway (two API keys), a
real worker on the default model (SmolLM2-135M-Instruct), a real Redis; one stack for the module."""

from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from tests.support.batch_files import poll
from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "sk-responses-a-01", "sk-responses-b-02"
KEYS = f"{KEY_A},{KEY_B}"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}


@dataclass
class Stack:
    url: str  # the gateway's
    redis_url: str


@pytest.fixture(scope="module")
async def stack(redis_server, default_model):
    redis = aioredis.Redis.from_url(redis_server.url)
    await redis.flushall()
    await redis.aclose()
    async with (
        real_worker(redis_server.url, default_model, kv_memory="64MiB"),
        running_gateway(redis_server.url, api_keys=KEYS) as url,
    ):
        yield Stack(url, redis_server.url)


def client(stack: Stack | str, key: str = KEY_A) -> openai.AsyncOpenAI:
    url = stack.url if isinstance(stack, Stack) else stack
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def test_text_is_stored_owned_by_its_key_and_deleted(stack):
    a, b = client(stack), client(stack, KEY_B)
    response = await a.responses.create(
        model=REAL_MODEL, instructions="You are brief.", input="What is the capital of France?",
        max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text and response.output[0].type == "message"
    assert response.usage.output_tokens == 6
    assert response.usage.input_tokens > 0 and response.usage.input_tokens_details.cached_tokens >= 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.usage.total_tokens == response.usage.input_tokens + 6
    scored = await a.responses.create(
        model=REAL_MODEL, input="What is the capital of France?", include=["message.output_text.logprobs"],
        top_logprobs=2, max_output_tokens=3, temperature=0, extra_body={"ignore_eos": True}, store=False,
    )  # fmt: skip
    part = scored.output[0].content[0]
    assert len(part.logprobs) == 3 and "".join(entry.token for entry in part.logprobs) == part.text
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in part.logprobs)
    with pytest.raises(openai.NotFoundError):
        await a.responses.retrieve(scored.id)  # store: false
    again = await a.responses.retrieve(response.id)
    assert again.output_text == response.output_text and again.usage == response.usage
    for call in (b.responses.retrieve(response.id), b.responses.delete(response.id), b.responses.cancel(response.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    await a.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        await a.responses.retrieve(response.id)


async def test_a_forced_call_then_its_output_continues_the_stored_conversation(stack):
    a = client(stack)
    ask = "What is the weather in Paris?"
    called = await a.responses.create(
        model=REAL_MODEL, input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=48, temperature=0
    )
    assert called.status == "completed"
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments).keys() == {"city"}
    follow_up = [{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}]
    counted = await a.responses.input_tokens.count(
        model=REAL_MODEL, input=follow_up, previous_response_id=called.id, tools=[WEATHER]
    )
    answer = await a.responses.create(
        model=REAL_MODEL, input=follow_up, previous_response_id=called.id, tools=[WEATHER],
        max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert answer.previous_response_id == called.id and answer.output[0].type == "message"
    assert answer.usage.input_tokens == counted.input_tokens > called.usage.input_tokens  # the first turn is in it
    assert answer.usage.input_tokens_details.cached_tokens > 0  # its prefix served from the cache


async def test_a_structured_stream_accumulates_to_the_final_response(stack):
    a = client(stack)
    text = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    async with a.responses.stream(
        model=REAL_MODEL, input="Which city is the capital of France?", text=text, max_output_tokens=32, temperature=0
    ) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    assert final.status == "completed"
    assert json.loads(final.output_text)["city"] in ("Paris", "London", "Rome")
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text


async def ended_by_length(stack: Stack) -> float:
    """lmq_requests_total of the module's gateway for responses that ended at max_output_tokens."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY_A}"}) as session:
        async with session.get(stack.url + "/metrics") as reply:
            metrics = await reply.text()
    wanted = 'lmq_requests_total{api="responses",model="tiny",outcome="length"} '
    return sum(float(line.removeprefix(wanted)) for line in metrics.splitlines() if line.startswith(wanted))


async def test_background_survives_its_gateway_and_streams_again(stack):
    before = await ended_by_length(stack)
    redis = aioredis.Redis.from_url(stack.redis_url)
    async with running_gateway(stack.redis_url, api_keys=KEYS) as other:
        queued = await client(other).responses.create(
            model=REAL_MODEL, input="Count to twenty.", background=True, max_output_tokens=64, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert queued.status == "queued" and queued.background

        async def streaming() -> bool:  # the other gateway drives it: some deltas are written
            return await redis.xlen(f"lmq:response:{queued.id}:events") >= 8

        await poll(streaming, what="the first deltas", interval=0.05)
    await redis.aclose()  # the gateway that drove it so far is gone now
    a = client(stack)

    async def ended():
        response = await a.responses.retrieve(queued.id)
        return response if response.status not in ("queued", "in_progress") else None

    done = await poll(ended, what="the background response's end")
    assert done.status == "incomplete" and done.usage.output_tokens == 64
    stream = await a.responses.retrieve(queued.id, stream=True)
    events = [event async for event in stream]
    assert [event.sequence_number for event in events] == list(range(len(events)))  # nothing twice, nothing lost
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.output_text
    later = await a.responses.retrieve(queued.id, stream=True, starting_after=len(events) - 2)
    assert [event.type async for event in later] == ["response.incomplete"]
    assert await ended_by_length(stack) == before + 1  # counted once, by the gateway that ended it


async def test_cancel_a_background_response(stack):
    a = client(stack)
    queued = await a.responses.create(
        model=REAL_MODEL, input="Write a long story.", background=True, max_output_tokens=2000,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    cancelled = await a.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"

    async def ended():
        redis = aioredis.Redis.from_url(stack.redis_url)
        try:
            state = await redis.hget(f"lmq:response:{queued.id}", "state")
        finally:
            await redis.aclose()
        return state not in (None, b"running")

    await poll(ended, what="the cancelled response's end")
    final = await a.responses.retrieve(queued.id)
    assert final.status == "cancelled" and final.usage is None


async def test_bad_parameters_are_refused_by_name(stack):
    a = client(stack)
    bad = {
        "temperature": {"temperature": 3},
        "max_output_tokens": {"max_output_tokens": 0},
        "tools[0].type": {"tools": [{"type": "web_search"}]},
        "text.format.type": {"text": {"format": {"type": "xml"}}},
        "reasoning.effort": {"reasoning": {"effort": "max"}},
        "reasoning.summary": {"reasoning": {"summary": "auto"}},
        "background": {"background": True, "store": False},
        "conversation": {"conversation": "conv_1"},
        "input[0].type": {"input": [{"type": "input_image", "image_url": "http://x"}]},
        "include": {"include": ["message.output_text.logprobs"], "tools": [WEATHER]},
        "include[0]": {"include": ["file_search_call.results"]},
        "tool_choice.name": {"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
    }
    for param, fields in bad.items():
        with pytest.raises(openai.BadRequestError) as refused:
            await a.responses.create(**({"model": REAL_MODEL, "input": "Hi"} | fields))
        assert refused.value.body["param"].startswith(param.split(".")[0]), (param, refused.value.body)
        assert param.split("[")[0].split(".")[0] in refused.value.message
    with pytest.raises(openai.NotFoundError):
        await a.responses.create(model=REAL_MODEL, input="Hi", previous_response_id="resp_" + "0" * 32)
    with pytest.raises(openai.BadRequestError) as refused:
        await a.responses.create(model=REAL_MODEL, input="Hi", extra_body={"frobnicate": 1})
    assert refused.value.body["param"] == "frobnicate"
