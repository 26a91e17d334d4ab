"""Each API key's share of the queue (gateway/queue_share.py): key A floods, key B is still served.

No worker reads the stream until the flood is in place, so every entry waits; then a scripted one
serves (tests/support/gateway_harness.py). `max_queue=8` (the streams' room) and `max_queue_per_key=4`."""

from __future__ import annotations

import asyncio
import hashlib
import time

import anthropic
import openai
import pytest

import protocol
from protocol.keys import rate_limit_key
from tests.support.gateway_harness import MODEL, announce, running_gateway, words_script, worker_running

MESSAGES = [{"role": "user", "content": "hi"}]
SETTINGS = dict(api_keys="key-a,key-b", max_queue=8, max_queue_per_key=4)


def client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def ask(url: str, key: str, n: int = 1):
    return client(url, key).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=n)


def share_of(key: str) -> str:
    return rate_limit_key(hashlib.sha256(key.encode()).hexdigest()[:32], "queued")


async def waiting_in_share(redis_client, key: str, count: int) -> None:
    for _ in range(100):
        if await redis_client.zcard(share_of(key)) == count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} never had {count} entries waiting in its share")


async def waiting_in_stream(redis_client, count: int) -> None:
    for _ in range(100):
        if await redis_client.xlen(protocol.request_stream(MODEL)) == count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the stream never held {count} entries")


async def test_a_flooding_key_gets_429_and_another_key_is_still_served(redis_url, redis_client):
    await announce(redis_client)  # the model is known; nobody reads its stream yet
    async with running_gateway(redis_url, **SETTINGS) as one, running_gateway(redis_url, **SETTINGS) as two:
        flood = asyncio.create_task(ask(one, "key-a", n=4))  # 4 entries: all of A's share
        await waiting_in_stream(redis_client, 4)
        more = asyncio.create_task(ask(two, "key-a", n=4))  # would fill the streams' 8 places
        await asyncio.wait([more], timeout=2)
        served = asyncio.create_task(ask(one, "key-b", n=2))
        await asyncio.wait([served], timeout=1)
        assert not served.done(), served.exception()  # B waits in the queue (not a 429 for a full queue)
        with pytest.raises(openai.RateLimitError) as refused:
            await more  # the share is counted across gateways
        assert refused.value.code == "rate_limit_exceeded" and int(refused.value.response.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.RateLimitError) as refused_anthropic:
            await anthropic.AsyncAnthropic(base_url=one, api_key="key-a", max_retries=0).messages.create(
                model=MODEL, max_tokens=3, messages=MESSAGES
            )
        assert (
            refused_anthropic.value.status_code == 429
            and refused_anthropic.value.body["error"]["type"] == "rate_limit_error"
        )
        await waiting_in_share(redis_client, "key-a", 4)  # refused entries took no place
        await waiting_in_share(redis_client, "key-b", 2)
        started = time.monotonic()
        async with worker_running(redis_client, words_script(["a", "b", "c"])):
            answer = await asyncio.wait_for(served, 10)
            assert [choice.message.content for choice in answer.choices] == ["abc", "abc"]
            assert time.monotonic() - started < 5
            assert len((await asyncio.wait_for(flood, 10)).choices) == 4
        assert await redis_client.zcard(share_of("key-a")) == 0 and await redis_client.zcard(share_of("key-b")) == 0


async def test_a_withdrawn_request_frees_its_place(redis_url, redis_client):
    await announce(redis_client)
    async with running_gateway(redis_url, **SETTINGS) as url:
        flood = asyncio.create_task(ask(url, "key-a", n=4))
        await waiting_in_share(redis_client, "key-a", 4)
        flood.cancel()  # the client hangs up: its entries are withdrawn and their places freed
        await waiting_in_share(redis_client, "key-a", 0)
        async with worker_running(redis_client, words_script(["a"])):
            assert len((await ask(url, "key-a", n=4)).choices) == 4


async def test_a_dead_gateways_claims_expire(redis_url, redis_client):
    """A claim outlives no pickup timeout: claims a dead gateway left behind stop counting."""
    await redis_client.zadd(share_of("key-a"), {f"dead-{i}": time.time() * 1000 - 1 for i in range(4)})
    async with worker_running(redis_client, words_script(["a"])), running_gateway(redis_url, **SETTINGS) as url:
        assert len((await ask(url, "key-a", n=4)).choices) == 4
