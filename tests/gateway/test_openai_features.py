"""What applications send through the official `openai` SDK: structured output, tools, logprobs, n,
sampling semantics, early errors and /tokenize, against a gateway and a real worker (tiny model)."""

from __future__ import annotations

import json
import math

import aiohttp
import jsonschema
import openai
import pytest

import protocol
from tests.support.gateway_harness import MODEL, REAL_MODEL, real_worker, running_gateway, words_script, worker_running

MESSAGES = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
# Every schema here bounds its strings and arrays, and the grammar bounds whitespace, so a constrained
# answer ends within this many tokens whatever the (random) model prefers.
LONG = 1500
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}


def client(api_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=api_url + "/v1", api_key="unused", max_retries=0)


# ---------------------------------------------------------------- structured output


@pytest.mark.slow  # six long constrained answers: seconds
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_json_schema_output_always_validates_whole_and_streamed(api_url, seed):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ask = dict(
        model=REAL_MODEL,
        messages=MESSAGES,
        max_tokens=LONG,
        temperature=1.0,
        seed=seed,
        response_format=response_format,
    )
    whole = await client(api_url).chat.completions.create(**ask)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    stream = await client(api_url).chat.completions.create(**ask, stream=True)
    streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert streamed == whole.choices[0].message.content  # the same seed, the same constrained draw


async def test_json_object_output_is_an_object(api_url):
    answer = await client(api_url).chat.completions.create(
        model=REAL_MODEL,
        messages=MESSAGES,
        max_tokens=120,
        temperature=0.7,
        seed=5,
        response_format={"type": "json_object"},
    )
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the beginning of an object
        assert answer.choices[0].message.content.lstrip().startswith("{")


async def test_an_invalid_schema_is_a_400_even_when_streaming(api_url):
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
    }
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            await client(api_url).chat.completions.create(
                model=REAL_MODEL, messages=MESSAGES, max_tokens=5, response_format=bad, stream=stream
            )


# ---------------------------------------------------------------- tools


@pytest.mark.slow  # three answers of up to 1,500 constrained tokens: seconds
async def test_required_tool_choice_gives_calls_whose_arguments_validate(api_url):
    for seed in range(3):
        answer = await client(api_url).chat.completions.create(
            model=REAL_MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME],
            tool_choice="required", max_tokens=LONG, temperature=1.0, seed=seed,
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_named_tool_and_no_parallel_calls_give_exactly_that_call(api_url):
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = await client(api_url).chat.completions.create(
        model=REAL_MODEL, messages=[{"role": "user", "content": "Time?"}], tools=[WEATHER, TIME], tool_choice=named,
        parallel_tool_calls=False, max_tokens=LONG, temperature=0.8, seed=3,
    )  # fmt: skip
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])
    assert answer.choices[0].finish_reason == "tool_calls"


@pytest.mark.slow  # two ~800-token constrained answers: seconds
async def test_streamed_tool_calls_are_assembled_by_the_sdk(api_url):
    ask = dict(
        model=REAL_MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=LONG,
        temperature=0.9,
        seed=1,  # three calls in ~800 tokens (seed 11: six in the whole 1,500, twice as long)
    )
    whole = await client(api_url).chat.completions.create(**ask)
    async with client(api_url).chat.completions.stream(**ask) as stream:
        final = await stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert final.choices[0].finish_reason == "tool_calls"


async def test_a_tool_result_turn_is_accepted(api_url):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]  # fmt: skip
    answer = await client(api_url).chat.completions.create(
        model=REAL_MODEL, messages=messages, tools=[WEATHER], max_tokens=5, temperature=0
    )
    assert answer.usage.prompt_tokens > 40  # the tools, the call and its result were all rendered
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


# ---------------------------------------------------------------- logprobs


async def test_chat_logprobs_whole_and_streamed(api_url):
    ask = dict(
        model=REAL_MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    whole = await client(api_url).chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob)
        assert [alt.logprob for alt in entry.top_logprobs] == sorted(
            (alt.logprob for alt in entry.top_logprobs), reverse=True
        )
    assert (
        b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace") == whole.choices[0].message.content
    )
    stream = await client(api_url).chat.completions.create(**ask, stream=True)
    streamed = [
        entry
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


async def test_no_logprobs_unless_asked(api_url):
    answer = await client(api_url).chat.completions.create(model=REAL_MODEL, messages=MESSAGES, max_tokens=3)
    assert answer.choices[0].logprobs is None


async def test_legacy_completion_logprobs(api_url):
    answer = await client(api_url).completions.create(
        model=REAL_MODEL, prompt="The fox", max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(
        len(top) == 2 and max(top.values()) == pytest.approx(lp)
        for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs)
    )
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


# ---------------------------------------------------------------- n choices


async def test_n_choices_whole_and_streamed(api_url):
    ask = dict(
        model=REAL_MODEL, messages=MESSAGES, max_tokens=6, n=3, temperature=1.0, seed=7, extra_body={"ignore_eos": True}
    )
    whole = await client(api_url).chat.completions.create(**ask)
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 18
    again = await client(api_url).chat.completions.create(**ask)
    assert [c.message.content for c in again.choices] == [c.message.content for c in whole.choices]  # seeded per choice
    assert again.usage.prompt_tokens == whole.usage.prompt_tokens  # the prompt counted once
    stream = await client(api_url).chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    texts, finished = ["", "", ""], set()
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
        if chunk.usage:
            assert chunk.usage.completion_tokens == 18
    assert finished == {0, 1, 2}
    assert texts == [c.message.content for c in whole.choices]


async def test_legacy_completions_n(api_url):
    answer = await client(api_url).completions.create(
        model=REAL_MODEL, prompt="The fox", max_tokens=4, n=2, seed=3, extra_body={"ignore_eos": True}
    )
    assert [choice.index for choice in answer.choices] == [0, 1] and answer.usage.completion_tokens == 8


async def test_legacy_completions_with_a_list_of_prompts(api_url):
    """Each prompt gets its own n choices, indexed prompt × n + choice; usage counts every prompt once."""
    sdk = client(api_url)
    prompts = ["The fox", "A cat sat on the"]
    ask = dict(model=REAL_MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    alone = [await sdk.completions.create(prompt=prompt, **ask) for prompt in prompts]
    answer = await sdk.completions.create(prompt=prompts, n=2, **ask)
    assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in answer.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert (
        answer.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) and answer.usage.completion_tokens == 16
    )
    stream = await sdk.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **ask)
    texts, usage = ["", ""], None
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [a.choices[0].text for a in alone]
    assert usage.prompt_tokens == answer.usage.prompt_tokens and usage.completion_tokens == 8
    async with aiohttp.ClientSession() as http:
        token_ids = [
            (await (await http.post(api_url + "/tokenize", json={"model": REAL_MODEL, "prompt": prompt})).json())[
                "tokens"
            ]
            for prompt in prompts
        ]
    by_ids = await sdk.completions.create(prompt=token_ids, **ask)
    assert [choice.text for choice in by_ids.choices] == [a.choices[0].text for a in alone]
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\]"):
        await sdk.completions.create(prompt=["fine", {"not": "a prompt"}], **ask)  # type: ignore[list-item]


# ---------------------------------------------------------------- errors before any reply, tokenize


async def test_a_refused_streaming_request_is_a_400_before_any_chunk(api_url):
    with pytest.raises(openai.BadRequestError) as error:
        await client(api_url).chat.completions.create(
            model=REAL_MODEL, messages=[{"role": "user", "content": "fox " * 3000}], max_tokens=4, stream=True
        )
    assert error.value.body["code"] == "prompt_too_long"


async def test_tokenize_and_detokenize_round_trip(api_url):
    async with aiohttp.ClientSession() as http:
        async with http.post(
            api_url + "/tokenize",
            json={"model": REAL_MODEL, "prompt": "The quick brown fox", "return_token_strs": True},
        ) as response:
            tokens = await response.json()
        async with http.post(
            api_url + "/detokenize", json={"model": REAL_MODEL, "tokens": tokens["tokens"]}
        ) as response:
            text = await response.json()
        async with http.post(api_url + "/tokenize", json={"model": REAL_MODEL, "messages": MESSAGES}) as response:
            chat = await response.json()
        async with http.post(api_url + "/detokenize", json={"model": REAL_MODEL, "tokens": [10**6]}) as response:
            assert response.status == 400
    assert tokens["count"] == len(tokens["tokens"]) > 0 and "".join(tokens["token_strs"]).endswith("fox")
    assert text["prompt"].endswith("The quick brown fox")
    answer = await client(api_url).chat.completions.create(model=REAL_MODEL, messages=MESSAGES, max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens  # what a request would read


# ---------------------------------------------------------------- sampling semantics (what reaches the worker)


async def test_explicit_sampling_is_not_cut_by_server_defaults(redis_url, redis_client):
    async with worker_running(redis_client, words_script(["ok"])) as received, running_gateway(redis_url) as url:
        async with aiohttp.ClientSession() as http:
            for extra in ({"temperature": 1}, {}, {"top_p": 0.5}):
                body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}
                async with http.post(url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200, await response.text()
    explicit, defaulted, top_p = (request.sampling for request in received)
    assert (explicit.temperature, explicit.top_p, explicit.top_k, explicit.min_p) == (1.0, 1.0, 0, 0.0)
    assert (defaulted.temperature, defaulted.top_p, defaulted.top_k, defaulted.min_p) == (
        0.8,
        0.95,
        40,
        0.05,
    )  # --sampling-defaults
    assert (top_p.temperature, top_p.top_p, top_p.top_k, top_p.min_p) == (1.0, 0.5, 0, 0.0)


async def test_a_model_whose_workers_are_gone_is_503_with_retry_after(redis_url, redis_client):
    await redis_client.xgroup_create(
        protocol.request_stream("gone-model"), protocol.REQUEST_GROUP, id="0", mkstream=True
    )
    async with running_gateway(redis_url) as url:
        gone = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as error:
            await gone.chat.completions.create(model="gone-model", messages=MESSAGES, max_tokens=2)
        assert error.value.status_code == 503 and error.value.response.headers["Retry-After"] == "5"
        with pytest.raises(openai.NotFoundError):
            await gone.chat.completions.create(model="never-served", messages=MESSAGES, max_tokens=2)


@pytest.mark.slow
async def test_a_required_call_on_the_real_model_has_no_content(redis_url, default_model):
    # issue 29: `required` left the raw `<tool_call>` tags (a repeated call cut at max_tokens) in message.content.
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    ask = dict(
        model=REAL_MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[tool],
        tool_choice="required",
        max_tokens=200,
        temperature=0,
    )
    async with real_worker(redis_url, default_model, kv_memory="64MiB"), running_gateway(redis_url) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        answers = [
            await client.chat.completions.create(**ask),
            await client.chat.completions.create(**ask, parallel_tool_calls=False),
        ]
    for answer, longest in zip(answers, [100, 40]):  # one call is some 35 tokens: the output ended
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert not choice.message.content
        assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]
        assert answer.usage.completion_tokens < longest
