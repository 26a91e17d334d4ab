"""Per-key rate limits through both official SDKs: 429s and the headers each API documents, counters
shared through Redis by every gateway. The worker is scripted (tests/support/gateway_harness.py): each
answer is 3 words, and its `done` counts 7 prompt tokens, so a request uses 10 tokens."""

from __future__ import annotations

import anthropic
import openai
import pytest
from redis.crc import key_slot

from gateway.metrics import Metrics
from gateway.rate_limits import CHARGED_MS, Limits, RateLimiter
from protocol.keys import rate_limit_key
from tests.support.gateway_harness import MODEL, running_gateway, words_script, worker_running

MESSAGES = [{"role": "user", "content": "hi"}]


def openai_client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)  # the SDK would retry a 429 by itself


def anthropic_client(url: str, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)


async def ask_openai(url: str, key: str):
    return await openai_client(url, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=3
    )


@pytest.fixture
async def worker(redis_client):
    async with worker_running(redis_client, words_script(["a", "b", "c"])):
        yield


async def test_requests_a_minute_per_key_with_openais_headers(redis_url, worker):
    async with running_gateway(redis_url, api_keys="k1,k2", rate_limit_requests=2) as url:
        first, second = await ask_openai(url, "k1"), await ask_openai(url, "k1")
        assert [r.headers["x-ratelimit-remaining-requests"] for r in (first, second)] == ["1", "0"]
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-reset-requests"].endswith("s")
        assert "x-ratelimit-limit-tokens" not in first.headers  # no token limit set
        assert second.parse().choices[0].message.content == "abc"
        with pytest.raises(openai.RateLimitError) as refused:
            await ask_openai(url, "k1")
        error = refused.value
        assert error.status_code == 429 and error.code == "rate_limit_exceeded"
        assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert 1 <= int(error.response.headers["retry-after"]) <= 60
        other = await ask_openai(url, "k2")  # each key has its own counters
        assert other.headers["x-ratelimit-remaining-requests"] == "1"
        listed = await openai_client(url, "k1").models.with_raw_response.list()  # not a generation request: not counted
        assert listed.http_response.status_code == 200 and "x-ratelimit-limit-requests" not in listed.headers


async def test_anthropic_gets_its_own_headers_and_error_type(redis_url, worker):
    async with running_gateway(redis_url, api_keys="k1", rate_limit_requests=1) as url:
        client = anthropic_client(url, "k1")
        ok = await client.messages.with_raw_response.create(model=MODEL, max_tokens=3, messages=MESSAGES)
        assert ok.headers["anthropic-ratelimit-requests-limit"] == "1"
        assert ok.headers["anthropic-ratelimit-requests-remaining"] == "0"
        assert ok.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
        with pytest.raises(anthropic.RateLimitError) as refused:
            await client.messages.create(model=MODEL, max_tokens=3, messages=MESSAGES)
        assert refused.value.status_code == 429  # not the 529 of an overloaded service
        assert refused.value.body["error"]["type"] == "rate_limit_error"
        assert int(refused.value.response.headers["retry-after"]) >= 1


async def test_tokens_a_minute_count_what_answers_used(redis_url, worker):
    async with running_gateway(redis_url, api_keys="k1", rate_limit_tokens=15) as url:
        first = await ask_openai(url, "k1")
        assert (
            first.headers["x-ratelimit-limit-tokens"] == "15" and first.headers["x-ratelimit-remaining-tokens"] == "15"
        )
        second = await ask_openai(url, "k1")
        assert second.headers["x-ratelimit-remaining-tokens"] == "5"  # the first used 7 + 3
        with pytest.raises(openai.RateLimitError) as refused:
            await ask_openai(url, "k1")  # 20 used: over 15
        assert refused.value.response.headers["x-ratelimit-remaining-tokens"] == "0"
        assert refused.value.body["type"] == "tokens"


async def test_gateways_share_the_counters(redis_url, worker):
    settings = dict(api_keys="k1", rate_limit_requests=3)
    async with running_gateway(redis_url, **settings) as one, running_gateway(redis_url, **settings) as two:
        await ask_openai(one, "k1")
        await ask_openai(two, "k1")
        third = await ask_openai(one, "k1")
        assert third.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError):
            await ask_openai(two, "k1")


async def test_a_key_file_line_sets_that_keys_own_limits(redis_url, worker, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team a is limited, team b is not\nteam-a requests=1 tokens=1000\nteam-b\n")
    async with running_gateway(redis_url, api_keys_file=str(keys)) as url:
        await ask_openai(url, "team-a")
        with pytest.raises(openai.RateLimitError):
            await ask_openai(url, "team-a")
        for _ in range(3):
            answer = await ask_openai(url, "team-b")
            assert "x-ratelimit-limit-requests" not in answer.headers
        with pytest.raises(openai.AuthenticationError):
            await ask_openai(url, "requests=1")  # the options are not keys


async def test_a_keys_counters_share_one_hash_slot_and_never_spell_the_key(redis_url, redis_client, worker):
    """The admission script reads and writes both counters: on a Redis Cluster they must lie in one slot."""
    async with running_gateway(redis_url, api_keys="sk-secret-7", rate_limit_requests=5, rate_limit_tokens=1000) as url:
        await ask_openai(url, "sk-secret-7")
    names = sorted([key.decode() async for key in redis_client.scan_iter(match="lmq:ratelimit:*")])
    assert [name.rsplit(":", 1)[1] for name in names] == ["requests", "tokens"]
    assert len({key_slot(name.encode()) for name in names}) == 1 and all("{" in name for name in names)
    assert not any("sk-secret-7" in name for name in names)


async def test_a_charge_made_again_counts_once_and_its_marker_expires(redis_client):
    """A batch item's tokens may be charged again (a lost reply, a driver that died before marking
    them paid: gateway/batches/runner.py): counted once per charge id, the marker in the counters' slot."""
    limiter = RateLimiter(redis_client, {"": Limits()}, Metrics())
    for _ in range(2):
        await limiter.charge_owner_once("d1", "batch_x.3", 25)
    await limiter.charge_owner_once("d1", "batch_x.4", 5)
    assert int(await redis_client.get(rate_limit_key("d1", "tokens"))) == 30
    marker = rate_limit_key("d1", "charged:batch_x.3")
    assert key_slot(marker.encode()) == key_slot(rate_limit_key("d1", "tokens").encode())
    assert 0 < await redis_client.pttl(marker) <= CHARGED_MS
