"""Batches on a Redis Cluster of three primaries: a real gateway and a real worker on the tiny model.

Everything a batch touches lives in the home shard (gateway/batches/store.py): its hashes, its
items' request stream, their reply streams. On a cluster that is what lets the enqueue script, the
worker's step script and the batch transactions run at all, since each may only touch keys of one
hash slot; so these tests run batches to their end and then look at where every key went.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import anthropic
import openai
import pytest
from redis.crc import key_slot

from gateway.batches.store import RETENTION_S, BatchStore
from lmq.redis_cluster import EmbeddedCluster
from protocol.cluster_url import shard_layout
from protocol.redis_client import connect
from tests.support.batch_files import chat_line, file_lines, jsonl, openai_batch_end, poll, slow
from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway


@pytest.fixture(scope="module")
def cluster() -> EmbeddedCluster:
    with EmbeddedCluster(primaries=3, shards=6) as started:
        yield started


@pytest.fixture
def cluster_url(cluster: EmbeddedCluster) -> str:
    cluster.flush()
    return cluster.url


@pytest.fixture
async def url(cluster_url, tiny):
    async with real_worker(cluster_url, tiny), running_gateway(cluster_url) as url:
        yield url


def assert_batch_keys_at_home(cluster: EmbeddedCluster) -> None:
    """Every key of batches and files carries the home shard's tag, so one slot of one node holds them all."""
    home = shard_layout(cluster.url).home
    assert home.tag is not None
    keys = cluster.all_keys("lmq:*")
    batch_keys = [key for key in keys if any(part in key for part in (":batch:", ":batches", ":file:", ":files"))]
    assert batch_keys, "no batch keys at all"
    assert all(key.startswith(home.key("")) for key in batch_keys), [
        key for key in batch_keys if not key.startswith(home.key(""))
    ]
    assert {key_slot(key.encode()) for key in batch_keys} == {key_slot(home.key("files").encode())}


async def test_an_openai_batch_runs_to_completion_on_a_cluster(url, cluster):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    prompts = {f"q{i}": f"Question {i}: what comes after {i}?" for i in range(8)}
    upload = await client.files.create(
        file=("in.jsonl", jsonl([chat_line(cid, p) for cid, p in prompts.items()])), purpose="batch"
    )
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = await openai_batch_end(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (8, 0)
    lines = await file_lines(client, batch.output_file_id)
    assert Counter(line["custom_id"] for line in lines) == Counter(list(prompts))
    assert all(line["response"]["body"]["usage"]["completion_tokens"] == 4 for line in lines)
    assert_batch_keys_at_home(cluster)


def message_params(prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": REAL_MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
    }


async def message_batch_end(client: anthropic.AsyncAnthropic, batch_id: str):
    async def check():
        batch = await client.messages.batches.retrieve(batch_id)
        return batch if batch.processing_status == "ended" else None

    return await poll(check, what=f"batch {batch_id} to end")


async def test_an_anthropic_message_batch_runs_to_the_end_on_a_cluster(url, cluster):
    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    requests = [{"custom_id": f"m-{i}", "params": message_params(f"Say {i}")} for i in range(8)]
    batch = await message_batch_end(client, (await client.messages.batches.create(requests=requests)).id)
    assert (batch.request_counts.succeeded, batch.request_counts.errored) == (8, 0)
    found = [result async for result in await client.messages.batches.results(batch.id)]
    assert Counter(result.custom_id for result in found) == Counter(r["custom_id"] for r in requests)
    assert all(result.result.type == "succeeded" and result.result.message.usage.output_tokens <= 4 for result in found)
    assert_batch_keys_at_home(cluster)


async def test_cancelling_on_a_cluster_withdraws_runs_and_cancels_the_rest(cluster_url, cluster, tiny):
    """The paths a single Redis forgives: a withdrawal publishes a cancellation (a cluster pipeline
    refuses PUBLISH), and unstarted items are recorded by a pipelined script (a cluster pipeline
    does not load scripts)."""
    async with (
        real_worker(cluster_url, slow(tiny, 0.05), max_seqs=2),
        running_gateway(cluster_url, batch_in_flight=4) as url,
    ):
        client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
        batch = await client.messages.batches.create(
            requests=[{"custom_id": f"c{i}", "params": message_params(f"Count {i}", 6)} for i in range(24)]
        )

        async def some_done():
            return (await client.messages.batches.retrieve(batch.id)).request_counts.succeeded >= 2

        await poll(some_done, what="two results")
        await client.messages.batches.cancel(batch.id)
        batch = await message_batch_end(client, batch.id)
        found = [result async for result in await client.messages.batches.results(batch.id)]
    counts = batch.request_counts
    assert counts.succeeded >= 2 and counts.canceled > 0 and counts.succeeded + counts.canceled + counts.errored == 24
    assert Counter(result.custom_id for result in found) == Counter(f"c{i}" for i in range(24))


async def test_the_store_writes_together_with_one_slot_scripts_never_a_transaction(cluster_url, cluster):
    """A cluster client sends a MULTI's EXEC where its slot map said at the last refresh: a failover in
    between fails the transaction. So every write of the store that must land whole (a file's or a
    batch's record with its index entries, a batch's end, a deletion) is one script on the home slot:
    each lands with what belongs with it, and no node ever sees a MULTI."""
    for node in cluster.nodes:
        with node.client() as client:
            client.config_resetstat()
    redis = connect(cluster_url)
    store = BatchStore(redis, shard_layout(cluster_url).home)
    owner = "owner-a"

    async def lines():
        yield b'{"custom_id": "a"}\n'

    try:
        upload = await store.create_file("file-", owner, {"purpose": "batch", "filename": "in.jsonl"}, b"input\n")
        output = await store.write_generated_file(f"{upload.id}-output", owner, {"purpose": "batch_output"}, lines())
        assert {record.id for record in (await store.files(owner, None, 10))[0]} == {upload.id, output.id}
        assert 0 < await redis.ttl(store.home.file_key(upload.id)) <= RETENTION_S
        assert bytes(await store.file_data(output.id)) == b'{"custom_id": "a"}\n'

        batch = await store.create_batch("batch_", "openai", owner, {"status": "in_progress"}, ['{"custom_id": "a"}'])
        assert batch.id in await store.active()
        assert [found.id for found in (await store.batches("openai", owner, None, None, 10))[0]] == [batch.id]
        await store.ended(batch.id, status="completed")
        assert batch.id not in await store.active()
        assert (await store.batch(batch.id)).status == "completed"
        assert 0 < await redis.ttl(store.home.batch_key(batch.id)) <= RETENTION_S

        await store.delete_batch(batch)
        assert await store.batch(batch.id) is None
        assert (await store.batches("openai", owner, None, None, 10))[0] == []
        assert await store.delete_file(upload) is True
        assert await store.delete_file(upload) is False
        assert await store.file(upload.id, owner) is None
        assert [record.id for record in (await store.files(owner, None, 10))[0]] == [output.id]
    finally:
        await redis.aclose()
    for node in cluster.nodes:
        with node.client() as client:
            commands = client.info("commandstats")
        assert "cmdstat_multi" not in commands and "cmdstat_exec" not in commands, sorted(commands)
