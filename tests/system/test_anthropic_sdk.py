"""The official `anthropic` SDK (sync and async, streaming and not) against a gateway and a real worker."""

from __future__ import annotations

import asyncio

import anthropic
import pytest

from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "ignore_eos": True}  # passed as extra_body, as current SDKs require


@pytest.fixture
async def base_url(redis_url, tiny):
    async with real_worker(redis_url, tiny), running_gateway(redis_url, api_keys="secret") as url:
        yield url


async def test_async_client_whole_and_streamed_answers_agree(base_url):
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="secret", max_retries=0)
    whole = await client.messages.create(
        model=REAL_MODEL, max_tokens=8, system="Be brief.", messages=MESSAGES, extra_body=GREEDY
    )
    async with client.messages.stream(
        model=REAL_MODEL,
        max_tokens=8,
        system=[{"type": "text", "text": "Be brief."}],
        messages=MESSAGES,
        extra_body=GREEDY,
    ) as stream:
        streamed = "".join([text async for text in stream.text_stream])
        final = await stream.get_final_message()
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 8
    assert whole.id.startswith("msg_") and whole.model == REAL_MODEL
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    # the same prompt twice: the second read some of it from the prefix cache
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == whole.usage.input_tokens + (
        whole.usage.cache_read_input_tokens or 0
    )


async def test_sync_client_whole_streamed_and_beta(base_url):
    client = anthropic.Anthropic(base_url=base_url, api_key="secret", max_retries=0)

    def ask():
        whole = client.messages.create(model=REAL_MODEL, max_tokens=5, messages=MESSAGES, extra_body=GREEDY)
        with client.messages.stream(model=REAL_MODEL, max_tokens=5, messages=MESSAGES, extra_body=GREEDY) as stream:
            streamed = "".join(stream.text_stream)
        beta = client.beta.messages.create(
            model=REAL_MODEL, max_tokens=5, messages=MESSAGES, extra_body=GREEDY
        )  # POST /v1/messages?beta=true
        return whole, streamed, beta

    whole, streamed, beta = await asyncio.to_thread(ask)  # the sync client blocks: keep it off the gateway's loop
    assert streamed == whole.content[0].text == beta.content[0].text


async def test_count_tokens_matches_the_prompt_tokens_of_a_request(base_url):
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="secret", max_retries=0)
    counted = await client.messages.count_tokens(model=REAL_MODEL, system="Be brief.", messages=MESSAGES)
    message = await client.messages.create(
        model=REAL_MODEL, max_tokens=2, system="Be brief.", messages=MESSAGES, extra_body=GREEDY
    )
    assert counted.input_tokens > 0
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


async def test_a_wrong_key_is_an_authentication_error(base_url):
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        await client.messages.create(model=REAL_MODEL, max_tokens=2, messages=MESSAGES)


async def test_an_unknown_model_is_not_found(base_url):
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="secret", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="claude-opus-4", max_tokens=2, messages=MESSAGES)
