"""Token limits count what a request really cost: every choice's prompt and completion tokens, every
prompt of a legacy completion, and a request the client left midway (its prompt and the tokens
relayed so far). The worker is scripted (tests/support/gateway_harness.py): 3 words, 7 prompt tokens."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import openai

import protocol
from protocol.keys import rate_limit_key
from tests.support.gateway_harness import MODEL, running_gateway, words_script, worker_running

MESSAGES = [{"role": "user", "content": "hi"}]


def tokens_counter(key: str) -> str:
    return rate_limit_key(hashlib.sha256(key.encode()).hexdigest()[:32], "tokens")


async def charged(redis_client, key: str) -> int:
    for _ in range(50):  # the charge lands as the handler ends, just after the client has its answer
        value = await redis_client.get(tokens_counter(key))
        if value is not None:
            return int(value)
        await asyncio.sleep(0.05)
    return 0


async def test_every_choice_is_charged(redis_url, redis_client):
    async with (
        worker_running(redis_client, words_script(["a", "b", "c"])),
        running_gateway(redis_url, api_keys="k1", rate_limit_tokens=1000) as url,
    ):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=4)
        assert await charged(redis_client, "k1") == 4 * (7 + 3)  # each choice's prompt and its 3 tokens


async def test_every_prompt_of_a_legacy_completion_is_charged(redis_url, redis_client):
    async with (
        worker_running(redis_client, words_script(["a", "b", "c"])),
        running_gateway(redis_url, api_keys="k1", rate_limit_tokens=1000) as url,
    ):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
        await client.completions.create(model=MODEL, prompt=["one", "two", "three"], max_tokens=3, n=2)
        assert await charged(redis_client, "k1") == 6 * (7 + 3)


def first_token_then_silence(request: protocol.Request):
    return [[protocol.started_event(request.id, 0, 500)], [protocol.delta_event(request.id, 1, "a", [100], 0)]]


async def test_a_client_that_leaves_is_charged_its_prompt_and_tokens_so_far(redis_url, redis_client):
    async with (
        worker_running(redis_client, first_token_then_silence),
        running_gateway(redis_url, api_keys="k1", rate_limit_tokens=10_000) as url,
    ):
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 50, "stream": True}
            async with session.post(
                url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k1"}
            ) as response:
                async for line in response.content:
                    if b'"content"' in line and b'"a"' in line:
                        break  # the first token came: hang up
        assert await charged(redis_client, "k1") == 500 + 1
