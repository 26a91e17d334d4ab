"""What applications send through the official `anthropic` SDK: tools (auto, any, a named tool, none),
tool_use blocks streamed as input_json_delta, tool_result turns, a prefilled answer continued,
`system` as blocks and the prompt's size in message_start (tiny model; the continuation on the real one)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from tests.gateway.test_openai_features import LONG
from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def client(api_url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=api_url, api_key="unused", max_retries=0)


@pytest.mark.parametrize(
    "choice", [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}]
)
async def test_forced_tool_use_validates_whole_and_streamed(api_url, choice):
    # This SDK has no sampling arguments any more (Anthropic's newest models fix them): they travel in extra_body.
    ask = dict(
        model=REAL_MODEL,
        max_tokens=LONG,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice=choice,
        extra_body={"temperature": 0.9, "top_k": 50},
    )
    whole = await client(api_url).messages.create(**ask)
    assert whole.stop_reason == "tool_use"
    uses = [block for block in whole.content if block.type == "tool_use"]
    assert uses and all(use.name == "get_weather" and use.id.startswith("toolu_") for use in uses)
    for use in uses:
        jsonschema.validate(use.input, WEATHER["input_schema"])
    async with client(api_url).messages.stream(**ask) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use"
    for use in (block for block in final.content if block.type == "tool_use"):
        jsonschema.validate(use.input, WEATHER["input_schema"])
    assert (
        final.usage.input_tokens
        == whole.usage.input_tokens + whole.usage.cache_read_input_tokens - final.usage.cache_read_input_tokens
    )


async def test_structured_output_through_output_config(api_url):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    }
    answer = await client(api_url).messages.create(
        model=REAL_MODEL,
        max_tokens=LONG,
        messages=QUESTION,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"top_k": 50},
    )
    assert answer.stop_reason == "end_turn"
    jsonschema.validate(json.loads(answer.content[0].text), schema)


async def test_tool_choice_none_gives_text(api_url):
    answer = await client(api_url).messages.create(
        model=REAL_MODEL, max_tokens=8, messages=QUESTION, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert [block.type for block in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")


async def test_a_tool_result_turn_is_accepted(api_url):
    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris", "unit": "celsius"},
                }
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 degrees"}]},
    ]
    answer = await client(api_url).messages.create(model=REAL_MODEL, max_tokens=4, messages=messages, tools=[WEATHER])
    count = await client(api_url).messages.count_tokens(model=REAL_MODEL, messages=messages, tools=[WEATHER])
    assert count.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens > 100


async def test_message_start_carries_the_prompt_size_and_system_blocks_count(api_url):
    system = [{"type": "text", "text": "You are brief."}, {"type": "text", "text": "Answer in French."}]
    async with client(api_url).messages.stream(
        model=REAL_MODEL, max_tokens=3, system=system, messages=QUESTION
    ) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    start = next(event for event in events if event.type == "message_start")
    assert start.message.usage.input_tokens > 0
    assert start.message.usage.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens
    plain = await client(api_url).messages.count_tokens(model=REAL_MODEL, messages=QUESTION)
    assert start.message.usage.input_tokens > plain.input_tokens  # the system blocks were read


@pytest.mark.slow
async def test_a_prefilled_answer_is_continued_by_the_real_model(redis_url, default_model):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    async with real_worker(redis_url, default_model, kv_memory="64MiB"), running_gateway(redis_url) as url:
        answer = await client(url).messages.create(
            model=REAL_MODEL, max_tokens=4, messages=messages, extra_body={"temperature": 0}
        )
    assert answer.content[0].text.startswith(" Paris")


@pytest.mark.slow
async def test_a_forced_call_on_the_real_model_has_no_text_and_ends_with_tool_use(redis_url, default_model):
    # issue 29: `any` with parallel calls allowed leaked the raw `<tool_call>` tags into a text block and
    # ran on to max_tokens with the same call repeated (the worker now ends the output at a repeated call).
    paris = [{"role": "user", "content": "What is the weather in Paris?"}]
    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    async with real_worker(redis_url, default_model, kv_memory="64MiB"), running_gateway(redis_url) as url:
        answer = await client(url).messages.create(
            model=REAL_MODEL,
            max_tokens=200,
            messages=paris,
            tools=[tool],
            tool_choice={"type": "any"},
            extra_body={"temperature": 0},
        )
    assert answer.stop_reason == "tool_use"
    assert [block.type for block in answer.content if block.type == "text"] == []
    uses = [(block.name, json.dumps(block.input, sort_keys=True)) for block in answer.content]
    assert len(uses) == 1
    assert answer.usage.output_tokens < 100  # one call is some 35 tokens: the output ended, not max_tokens
