"""A batch's items across a Redis restart that lost writes: resumed from what the runner consumed, never run again.

In process: a Redis of the test's own with its append-only file, a real worker on the tiny model
(slowed steps, so items are mid-answer at the fault) and a gateway whose runner drives the batch.
The writes a promoted replica (or an `appendfsync everysec` file) may lack are played by hand: the
last entries each reply stream had are deleted, and one item's whole reply stream. Each item must
end once, by its first run, with the exact text of an undisturbed run (float32 greedy):

- Redis SIGKILLed while every item streams and started again: the runner keeps its in-flight items
  through the outage and goes on from what it consumed;
- the same through a Sentinel failover (the primary SIGKILLed, the replica promoted);
- a runner that had not read the lost entries (a gateway that takes the batch over) sees the holes
  and gets what is missing from the worker that still holds it (`lmq:resume`, docs/protocol.md);
- one whose streams lost their last entries, `done` included, after every item finished: no hole
  shows, so the runner that takes the batch over asks each run with no end yet at once.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

import protocol
from protocol.keys import batch_reply_stream
from tests.support.batch_files import chat_line, create_batch, file_lines, openai_batch_end, openai_client, poll, slow
from tests.support.gateway_harness import real_worker, running_gateway
from tests.support.sentinel_stack import SentinelSet

ITEMS = 4
MAX_TOKENS = 24
LOST_TAIL = 3  # entries each reply stream loses
DOWN_S = 1.0  # the outage: past the client's own retries (0.35 s), well within the resume bound

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # two runs on slowed steps each: seconds


def lines() -> list[dict]:
    return [chat_line(f"r{i}", f"Item {i}: the quick brown fox", max_tokens=MAX_TOKENS) for i in range(ITEMS)]


async def _answers(client, batch_id: str) -> dict[str, tuple[str, str]]:
    """custom_id -> (the answer's text, the request id that answered it)."""
    done = await openai_batch_end(client, batch_id, timeout=120)
    assert done.status == "completed" and done.request_counts.completed == ITEMS, done
    return {
        line["custom_id"]: (
            line["response"]["body"]["choices"][0]["message"]["content"],
            line["response"]["request_id"],
        )
        for line in await file_lines(client, done.output_file_id)
    }


async def _deltas(redis, key: str) -> int:
    return sum(1 for _, fields in await redis.xrange(key) if protocol.decode_event(fields[b"msg"])["type"] == "delta")


KINDS = ["redis6", "valkey9"]


async def _lose_tails(redis, keys: list[str], tails: dict[str, list]) -> None:
    """The writes the server lost: the first item's whole reply stream, the others' last entries."""
    await redis.delete(keys[0])
    for key in keys[1:]:
        await redis.xdel(key, *tails[key])


async def _mid_answer(redis, batch_id: str) -> tuple[list[str], dict[str, list]]:
    """Once every item streams: its reply streams, and the last LOST_TAIL entry ids of each."""
    keys = [batch_reply_stream(batch_id, index, 1) for index in range(ITEMS)]

    async def all_streaming():
        return all([await _deltas(redis, key) >= 4 for key in keys])

    await poll(all_streaming, what="every item mid-answer", interval=0.02)
    return keys, {key: [entry_id for entry_id, _ in (await redis.xrange(key))[-LOST_TAIL:]] for key in keys}


def _assert_once_and_exact(answers: dict, reference: dict) -> None:
    assert {custom_id: text for custom_id, (text, _) in answers.items()} == {
        custom_id: text for custom_id, (text, _) in reference.items()
    }
    assert all(request_id.endswith(".1") for _, request_id in answers.values()), answers  # no item ran twice


@pytest.mark.parametrize("kind", KINDS)
async def test_a_redis_restart_that_lost_reply_entries_resumes_every_item_once_with_its_exact_text(
    kind, fresh_redis_server, tiny
):
    server = fresh_redis_server(kind, appendonly=True)
    async with real_worker(server.url, slow(tiny, 0.05), max_seqs=ITEMS), running_gateway(server.url) as url:
        client, redis = openai_client(url), aioredis.Redis.from_url(server.url)
        try:
            reference = await _answers(client, (await create_batch(client, lines())).id)
            batch = await create_batch(client, lines())
            keys, tails = await _mid_answer(redis, batch.id)
            await asyncio.to_thread(server.kill)
            await asyncio.sleep(DOWN_S)
            await asyncio.to_thread(server.start)
            await _lose_tails(redis, keys, tails)
            answers = await _answers(client, batch.id)
        finally:
            await redis.aclose()
    _assert_once_and_exact(answers, reference)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_gateway_that_takes_over_reply_streams_with_holes_gets_them_filled_by_the_worker(
    kind, fresh_redis_server, tiny
):
    async def lose_the_tails_read(redis, keys: list[str], tails) -> None:
        await _lose_tails(redis, keys, tails)  # the stopped gateway had read them; its successor has not

    answers, reference = await _taken_over(fresh_redis_server(kind), tiny, lose_the_tails_read)
    _assert_once_and_exact(answers, reference)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_gateway_that_takes_over_reply_streams_that_lost_their_ends_gets_the_tails_from_the_worker(
    kind, fresh_redis_server, tiny
):
    async def lose_the_ends(redis, keys: list[str], _tails) -> None:
        await _all_done(redis, keys)  # the worker finished every item while no gateway drove the batch
        for key in keys:  # the writes lost: each stream's last entries, its `done` among them
            await redis.xdel(key, *[entry_id for entry_id, _ in (await redis.xrange(key))[-LOST_TAIL:]])

    answers, reference = await _taken_over(fresh_redis_server(kind), tiny, lose_the_ends)
    _assert_once_and_exact(answers, reference)


async def _taken_over(server, tiny, lose) -> tuple[list, list]:
    """A batch driven by gateway gw-a until mid-answer, `lose(redis, keys, tails)` played while no gateway
    drives it, then taken over by gw-b: its answers, and those of an undisturbed batch before it."""
    redis = aioredis.Redis.from_url(server.url)
    try:
        async with real_worker(server.url, slow(tiny, 0.05), max_seqs=ITEMS):
            async with running_gateway(server.url, gateway_id="gw-a") as url:
                client = openai_client(url)
                reference = await _answers(client, (await create_batch(client, lines())).id)
                batch = await create_batch(client, lines())
                keys, tails = await _mid_answer(redis, batch.id)
            await lose(redis, keys, tails)
            async with running_gateway(server.url, gateway_id="gw-b") as url:
                return await _answers(openai_client(url), batch.id), reference
    finally:
        await redis.aclose()


async def _all_done(redis, keys: list[str]) -> None:
    async def ended():
        return all(
            [
                any(protocol.decode_event(f[b"msg"])["type"] == "done" for _, f in await redis.xrange(key))
                for key in keys
            ]
        )

    await poll(ended, what="every item's done on its reply stream", interval=0.05)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_sentinel_failover_that_lost_reply_entries_resumes_every_item_once_with_its_exact_text(
    kind, tmp_path, tiny
):
    sentinels = await asyncio.to_thread(SentinelSet(tmp_path / "sentinels", kind).start)
    try:
        async with real_worker(sentinels.url, slow(tiny, 0.05), max_seqs=ITEMS), running_gateway(sentinels.url) as url:
            client, redis = openai_client(url), aioredis.Redis(port=sentinels.replica.port)
            try:
                reference = await _answers(client, (await create_batch(client, lines())).id)
                batch = await create_batch(client, lines())
                keys, tails = await _mid_answer(redis, batch.id)  # read on the replica, as replicated
                await asyncio.to_thread(sentinels.kill_primary)
                await sentinels.wait_failover()
                await _lose_tails(redis, keys, tails)
                answers = await _answers(client, batch.id)
            finally:
                await redis.aclose()
    finally:
        sentinels.close()
    _assert_once_and_exact(answers, reference)
