"""A background response whose reply stream lost entries (a failover's lost writes) ends with its exact text.

In process: a real worker on the tiny model (slowed steps, so the answer is mid-way), and gateways
that drive the response. The writes a promoted replica may lack are played by hand: the last entries
the worker's reply stream had. The gateway that drove it stops; the one that takes it over reads
the stream from its start, sees the hole, and must get what is missing from the worker that still
holds the request (`lmq:resume`, docs/protocol.md), not fail the response: it ends as an undisturbed
run of the same request does (float32 greedy).
"""

from __future__ import annotations

import asyncio
import logging

import openai
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError

import protocol
from gateway.auth import key_digest
from gateway.responses.store import ResponseStore
from protocol.keys import rate_limit_key
from tests.support.batch_files import poll, slow
from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway

LOST_TAIL = 3
DOWN_S = 1.0  # the outage: past the client's own retries (0.35 s), well within the resume bound
TERMINAL = ("completed", "incomplete", "failed", "cancelled")

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # two runs on slowed steps each: seconds


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def request() -> dict:
    return {"model": REAL_MODEL, "input": "Item 1: the quick brown fox", "max_output_tokens": 24, "temperature": 0}


async def _ended(client: openai.AsyncOpenAI, response_id: str):
    async def found():
        response = await client.responses.retrieve(response_id)
        return response if response.status in TERMINAL else None

    return await poll(found, what=f"background response {response_id} to end")


async def _deltas(redis, key: str) -> int:
    return sum(1 for _, fields in await redis.xrange(key) if protocol.decode_event(fields[b"msg"])["type"] == "delta")


async def test_a_gateway_that_takes_a_background_response_over_gets_the_holes_of_its_stream_filled(redis_url, tiny):
    async def lose_the_tail_read(redis, key: str, tail: list) -> None:
        await redis.xdel(key, *tail)  # the stopped gateway had read them; its successor has not

    done, reference = await _taken_over(redis_url, tiny, lose_the_tail_read)
    assert (done.status, done.error) == (reference.status, None), done.error
    assert done.output_text == reference.output_text and done.usage.output_tokens == reference.usage.output_tokens


async def _at_least(redis, key: str, deltas: int) -> bool:
    return await _deltas(redis, key) >= deltas


async def test_a_gateway_that_takes_over_a_finished_response_whose_stream_lost_its_end_gets_the_tail(redis_url, tiny):
    """The lost entries were the worker's last ones, `done` among them: no hole shows, so the driver
    that takes the response over asks the worker once it has read the stream to its end."""

    async def lose_the_end(redis, key: str, _tail: list) -> None:
        await poll(lambda: _has_done(redis, key), what="the worker to finish while no gateway drives it")
        await redis.xdel(key, *[entry_id for entry_id, _ in (await redis.xrange(key))[-LOST_TAIL:]])

    done, reference = await _taken_over(redis_url, tiny, lose_the_end)
    assert (done.status, done.error) == (reference.status, None), done.error
    assert done.output_text == reference.output_text and done.usage.output_tokens == reference.usage.output_tokens


async def _taken_over(redis_url: str, tiny, lose):
    """A background response driven by gateway gw-a until mid-answer (its stream's last LOST_TAIL entry ids
    then are `tail`), `lose(redis, key, tail)` played while no gateway drives it, then taken over by gw-b:
    how it ended, and how an undisturbed response of the same request ended before it."""
    redis = aioredis.Redis.from_url(redis_url)
    try:
        async with real_worker(redis_url, slow(tiny, 0.05)):
            async with running_gateway(redis_url, gateway_id="gw-a") as url:
                client = sdk(url)
                reference = await _ended(client, (await client.responses.create(**request(), background=True)).id)
                response = await client.responses.create(**request(), background=True)
                key = f"lmq:reply:response:{response.id}"
                await poll(lambda: _at_least(redis, key, 4), what="the answer mid-way", interval=0.02)
                tail = [entry_id for entry_id, _ in (await redis.xrange(key))[-LOST_TAIL:]]
            await lose(redis, key, tail)
            async with running_gateway(redis_url, gateway_id="gw-b") as url:
                return await _ended(sdk(url), response.id), reference
    finally:
        await redis.aclose()


async def _has_done(redis, key: str) -> bool:
    return any(protocol.decode_event(fields[b"msg"])["type"] == "done" for _, fields in await redis.xrange(key))


@pytest.mark.parametrize("kind", ["redis6", "valkey9"])
async def test_a_redis_restart_that_lost_reply_entries_is_ridden_out_by_the_driver_that_holds_the_response(
    kind, fresh_redis_server, tiny, caplog
):
    """Redis SIGKILLed mid-answer and started again from its append-only file, the reply stream
    losing its last entries: the driver keeps the lease through the outage (it is not handed back
    to wait for its expiry and a new driver), and the response ends with its exact text."""
    caplog.set_level(logging.INFO, logger="gateway.leased_drivers")
    server = fresh_redis_server(kind, appendonly=True)
    redis = aioredis.Redis.from_url(server.url)
    try:
        async with real_worker(server.url, slow(tiny, 0.05)), running_gateway(server.url) as url:
            client = sdk(url)
            reference = await _ended(client, (await client.responses.create(**request(), background=True)).id)
            response = await client.responses.create(**request(), background=True)
            key = f"lmq:reply:response:{response.id}"
            await poll(lambda: _at_least(redis, key, 4), what="the answer mid-way", interval=0.02)
            tail = [entry_id for entry_id, _ in (await redis.xrange(key))[-LOST_TAIL:]]
            await asyncio.to_thread(server.kill)
            await asyncio.sleep(DOWN_S)
            await asyncio.to_thread(server.start)
            await redis.xdel(key, *tail)
            done = await _ended(client, response.id)
    finally:
        await redis.aclose()
    assert (done.status, done.error) == (reference.status, None), done.error
    assert done.output_text == reference.output_text and done.usage.output_tokens == reference.usage.output_tokens
    driven = [r for r in caplog.records if r.getMessage() == f"driving background response {response.id}"]
    assert len(driven) == 1, [r.getMessage() for r in caplog.records]  # one driver, from start to end


async def test_a_background_response_whose_end_lost_its_reply_is_charged_to_its_key(
    redis_url, redis_client, tiny, monkeypatch
):
    """The end's write landed and its reply was lost (a connection cut): the driver, which charged the
    key only after the end answered, charged nothing, and the next drive finds the response ended."""
    end = ResponseStore.end
    cut: list[str] = []

    async def reply_lost(self, response_id, fields):
        await end(self, response_id, fields)
        if not cut:
            cut.append(response_id)
            raise ConnectionError("the connection broke before the reply")

    monkeypatch.setattr(ResponseStore, "end", reply_lost)
    async with (
        real_worker(redis_url, tiny),
        running_gateway(redis_url, api_keys="key-a", rate_limit_tokens=100_000) as url,
    ):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="key-a", max_retries=0)
        done = await _ended(client, (await client.responses.create(**request(), background=True)).id)
    assert cut == [done.id] and done.error is None and done.usage.total_tokens > 0
    assert int(await redis_client.get(rate_limit_key(key_digest("key-a"), "tokens")) or 0) == done.usage.total_tokens


async def test_the_driver_of_an_undisturbed_response_asks_no_resume(redis_url, tiny):
    """Only a driver that takes a response over (or drives it again after an outage) asks its worker to
    send again: the first one's ask would make the worker write its events again, and an answer landing
    after the response ended would make its reply stream again, with nobody to read it."""
    redis = aioredis.Redis.from_url(redis_url)
    asks = redis.pubsub()
    await asks.subscribe(protocol.resume.RESUME_CHANNEL)
    try:
        async with real_worker(redis_url, slow(tiny, 0.05)), running_gateway(redis_url) as url:
            client = sdk(url)
            response = await client.responses.create(**request(), background=True)
            done = await _ended(client, response.id)
        heard = []
        for _ in range(20):  # what the subscription holds (a None is also the subscribe confirmation)
            if (message := await asks.get_message(ignore_subscribe_messages=True, timeout=0.05)) is not None:
                heard.append(message["data"])
    finally:
        await asks.aclose()
        await redis.aclose()
    assert done.status == "incomplete" and done.error is None
    assert heard == [], "the response's own driver asked a resume"
