"""Files and batches belong to the API key that made them (issue 28, items 1, 7, 16): a real gateway
with two keys, a real worker on the tiny model, real Redis."""

from __future__ import annotations

import asyncio

import aiohttp
import anthropic
import openai
import pytest

from gateway.auth import key_digest
from gateway.batches.store import BatchStore
from protocol.keys import rate_limit_key
from tests.support.batch_files import (
    anthropic_client,
    chat_line,
    create_batch,
    file_lines,
    jsonl,
    message_batch_end,
    message_request,
    openai_batch_end,
    openai_client,
    poll,
    slow,
)
from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway

KEY_A, KEY_B = "sk-tenant-a-0001", "sk-tenant-b-0002"


async def not_found(call) -> None:
    with pytest.raises((openai.NotFoundError, anthropic.NotFoundError)):
        await call


@pytest.mark.slow  # seconds of batch runs: seconds
async def test_another_key_can_neither_see_nor_use_nor_remove_a_keys_files_and_batches(redis_url, redis_client, tiny):
    async with (
        real_worker(redis_url, slow(tiny, 0.05), max_seqs=2),
        running_gateway(redis_url, api_keys=f"{KEY_A},{KEY_B}", batch_in_flight=2) as url,
    ):
        a, b = openai_client(url, KEY_A), openai_client(url, KEY_B)
        upload = await a.files.create(
            file=("in.jsonl", jsonl([chat_line(f"q{i}", f"Say {i}", max_tokens=6) for i in range(8)])), purpose="batch"
        )
        batch = await a.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        a_msgs, b_msgs = anthropic_client(url, KEY_A), anthropic_client(url, KEY_B)
        message_batch = await a_msgs.messages.batches.create(requests=[message_request(f"m{i}", 6) for i in range(8)])

        assert [f async for f in b.files.list()] == [] and [x async for x in b.batches.list()] == []
        assert [x async for x in b_msgs.messages.batches.list()] == []
        await not_found(b.files.retrieve(upload.id))
        await not_found(b.files.content(upload.id))
        await not_found(b.files.delete(upload.id))
        await not_found(
            b.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        )
        await not_found(b.batches.retrieve(batch.id))
        await not_found(b.batches.cancel(batch.id))
        await not_found(b_msgs.messages.batches.retrieve(message_batch.id))
        await not_found(b_msgs.messages.batches.cancel(message_batch.id))
        await not_found(b_msgs.messages.batches.delete(message_batch.id))
        async with aiohttp.ClientSession(headers={"x-api-key": KEY_B}) as http:
            async with http.get(f"{url}/v1/messages/batches/{message_batch.id}/results") as response:
                assert response.status == 404

        batch = await openai_batch_end(a, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 8  # B's cancel did nothing
        assert len(await file_lines(a, batch.output_file_id)) == 8
        await not_found(b.files.content(batch.output_file_id))  # the output is A's too

        assert (await message_batch_end(a_msgs, message_batch.id)).request_counts.succeeded == 8
        assert sorted([f.id async for f in a.files.list()]) == sorted([upload.id, batch.output_file_id])
        assert [x.id async for x in a.batches.list()] == [batch.id]
        await a_msgs.messages.batches.delete(message_batch.id)
        await a.files.delete(upload.id)

    owner = key_digest(KEY_A)
    assert (await redis_client.hget(f"lmq:batch:{batch.id}", "owner")).decode() == owner
    async for key in redis_client.scan_iter(match="*"):  # the keys themselves are written nowhere
        assert KEY_A.encode() not in key and KEY_B.encode() not in key
        if (await redis_client.type(key)) == b"hash":
            for name, value in (await redis_client.hgetall(key)).items():
                assert KEY_A.encode() not in value and KEY_B.encode() not in value, (key, name)


async def test_without_keys_every_client_shares_one_anonymous_owner(redis_url, tiny):
    async with real_worker(redis_url, tiny), running_gateway(redis_url) as url:
        a, b = openai_client(url, "whatever-a"), openai_client(url, "whatever-b")
        upload = await a.files.create(file=("in.jsonl", jsonl([chat_line("x", "hi")])), purpose="batch")
        assert [f.id async for f in b.files.list()] == [upload.id]
        batch = await b.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert (await openai_batch_end(a, batch.id)).status == "completed"


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/files/{file}:data"),
        ("GET", "/v1/files/{file}:data/content"),
        ("DELETE", "/v1/files/{file}:data"),
        ("GET", "/v1/batches/{batch}:items"),
        ("POST", "/v1/batches/{batch}:inflight/cancel"),
        ("GET", "/v1/messages/batches/{msgbatch}:results"),
        ("GET", "/v1/messages/batches/{msgbatch}:items/results"),
        ("GET", "/v1/files/x%00y"),
        ("GET", "/v1/batches/" + "9" * 300),
    ],
)
async def test_a_malformed_id_in_the_url_is_a_404_and_never_reaches_redis(redis_url, tiny, method, path):
    """`<id>:data` named another kind of key: Redis answered WRONGTYPE and the gateway a 503 (issue 28, item 16)."""
    async with real_worker(redis_url, tiny), running_gateway(redis_url) as url:
        client = openai_client(url)
        upload = await client.files.create(file=("in.jsonl", jsonl([chat_line("x", "hi")])), purpose="batch")
        batch = await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        message_batch = await anthropic_client(url).messages.batches.create(requests=[message_request("m", 6)])
        async with aiohttp.ClientSession() as http:
            target = url + path.format(file=upload.id, batch=batch.id, msgbatch=message_batch.id)
            async with http.request(method, target) as response:
                assert response.status == 404, await response.text()
                assert "error" in await response.json()
            async with http.post(
                f"{url}/v1/batches",
                json={
                    "input_file_id": f"{upload.id}:data",
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            ) as response:
                assert response.status == 404, await response.text()
        await openai_batch_end(client, batch.id)


@pytest.mark.slow  # waits for the token budget: seconds
async def test_a_batch_counts_against_its_keys_token_limit_and_waits_for_the_budget(redis_url, redis_client, tiny):
    """A key limited to 100 tokens a minute ran 10,000 through a batch and was charged 32 (issue 28, item 7):
    now each item's real tokens are charged to the batch's key, and items wait while the key is over."""
    async with (
        real_worker(redis_url, tiny),
        running_gateway(redis_url, api_keys=KEY_A, rate_limit_tokens=100, batch_in_flight=8) as url,
    ):
        client = openai_client(url, KEY_A)
        lines = [chat_line(f"t{i}", f"Count to {i}", max_tokens=8) for i in range(12)]  # about 25 tokens each
        batch = await create_batch(client, lines)
        counter = rate_limit_key(key_digest(KEY_A), "tokens")

        async def stalled():
            found = await client.batches.retrieve(batch.id)
            charged = int(await redis_client.get(counter) or 0)
            over = charged >= 100 and not await redis_client.xlen(f"lmq:req:{REAL_MODEL}:batch")
            return found if over or found.status == "completed" else None

        await poll(stalled, what="the key's budget to be spent")
        with pytest.raises(openai.RateLimitError):  # the batch spent the key's budget for live requests too
            await client.chat.completions.create(
                model=REAL_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        await asyncio.sleep(1.0)  # the last runs' outcomes recorded (their entries are gone before that)
        before = await client.batches.retrieve(batch.id)
        await asyncio.sleep(2.0)
        paused = await client.batches.retrieve(batch.id)
        finished = paused.request_counts.completed + paused.request_counts.failed
        assert finished == before.request_counts.completed + before.request_counts.failed < 12  # nothing ran while over
        charged = int(await redis_client.getdel(counter))  # the window "resets": the batch goes on
        assert charged == paused.usage.total_tokens  # every finished item's real tokens, no more, no less
        while (batch := await client.batches.retrieve(batch.id)).status not in (
            "completed",
            "failed",
            "cancelled",
            "expired",
        ):
            await poll(stalled, what="the key's budget to be spent again, or the batch to end")
            charged += int(await redis_client.getdel(counter) or 0)
    assert batch.status == "completed" and batch.request_counts.completed == 12
    assert charged + int(await redis_client.get(counter) or 0) == batch.usage.total_tokens


@pytest.mark.slow  # a batch run: seconds
async def test_an_outcome_whose_write_was_retried_after_a_lost_reply_is_charged_once(
    redis_url, redis_client, tiny, monkeypatch
):
    """The client retries a script whose reply it lost (protocol/redis_client.py); the write had
    landed, so the retry answers "already written" and the item's tokens went uncharged (issue 30)."""
    record = BatchStore.record

    async def reply_lost(self, *args):
        await record(self, *args)  # it landed; its reply did not
        return await record(self, *args)  # the retry

    monkeypatch.setattr(BatchStore, "record", reply_lost)
    async with (
        real_worker(redis_url, tiny),
        running_gateway(redis_url, api_keys=KEY_A, rate_limit_tokens=100_000) as url,
    ):
        client = openai_client(url, KEY_A)
        batch = await create_batch(client, [chat_line(f"c{i}", f"Count to {i}", max_tokens=4) for i in range(3)])
        done = await openai_batch_end(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 3 and done.usage.total_tokens > 0
    assert int(await redis_client.get(rate_limit_key(key_digest(KEY_A), "tokens")) or 0) == done.usage.total_tokens
