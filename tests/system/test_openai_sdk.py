"""The official `openai` SDK (sync and async, streaming and not) against a gateway and a real worker."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway

MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture
async def base_url(redis_url, tiny):
    async with real_worker(redis_url, tiny), running_gateway(redis_url) as url:
        yield url + "/v1"


async def test_async_client_whole_and_streamed_answers_agree(base_url):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    whole = await client.chat.completions.create(
        model=REAL_MODEL, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    stream = await client.chat.completions.create(
        model=REAL_MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].message.content  # greedy: the same text either way
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: a prefix-cache hit


async def test_sync_client_whole_and_streamed(base_url):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)

    def ask() -> tuple[openai.types.chat.ChatCompletion, list]:
        whole = client.chat.completions.create(
            model=REAL_MODEL, messages=MESSAGES, max_completion_tokens=5, extra_body={"ignore_eos": True}, seed=1
        )
        chunks = list(
            client.chat.completions.create(
                model=REAL_MODEL, messages=MESSAGES, max_tokens=5, stream=True, extra_body={"ignore_eos": True}, seed=1
            )
        )
        return whole, chunks

    whole, chunks = await asyncio.to_thread(ask)  # the sync client blocks: keep it off the gateway's loop
    assert whole.usage.completion_tokens == 5
    assert (
        "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content
    )  # same seed
    assert all(chunk.usage is None for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1


async def test_legacy_completions_sync_and_async(base_url):
    async_client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    sync_client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    whole = await async_client.completions.create(
        model=REAL_MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = await asyncio.to_thread(
        lambda: list(
            sync_client.completions.create(
                model=REAL_MODEL,
                prompt="The quick brown fox",
                max_tokens=6,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
    )
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 6
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_models_list_shows_the_served_model(base_url):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    assert [model.id async for model in client.models.list()] == [REAL_MODEL]


async def test_a_prompt_too_long_is_a_400(base_url):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(
            model=REAL_MODEL, messages=[{"role": "user", "content": "fox " * 2000}], max_tokens=4
        )
    assert error.value.body["code"] == "prompt_too_long"
