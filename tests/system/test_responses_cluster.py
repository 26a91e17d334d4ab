"""The Responses API on a Redis Cluster of three primaries: a real gateway and a real worker on the tiny model.

Every key of a stored response lives in the home shard (gateway/responses/store.py), and so does a
background response's request stream and the worker's reply stream: the enqueue script and the
worker's step script may only touch keys of one hash slot. The store's writes that must land
together (a record with the active set, a background response's end, a deletion) are one-slot
scripts, never a MULTI: a cluster client sends a MULTI's EXEC where its slot map said at the last
refresh, and a failover in between fails it. So these tests run what a client does (store, GET,
previous_response_id, input_items, DELETE, a background response followed to its end) and then
look at where every key went and that no node saw a MULTI.
"""

from __future__ import annotations

import openai
import pytest
from redis.crc import key_slot

from gateway.responses.store import ResponseStore
from lmq.redis_cluster import EmbeddedCluster
from protocol.cluster_url import shard_layout
from protocol.redis_client import connect
from tests.support.batch_files import poll
from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway

TTL_S = 600


@pytest.fixture(scope="module")
def cluster() -> EmbeddedCluster:
    with EmbeddedCluster(primaries=3, shards=6) as started:
        yield started


@pytest.fixture
async def url(cluster, tiny):
    cluster.flush()
    for node in cluster.nodes:
        with node.client() as client:
            client.config_resetstat()
    async with real_worker(cluster.url, tiny), running_gateway(cluster.url, response_ttl=TTL_S) as url:
        yield url


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def turn(text: str, **fields):
    return (
        dict(model=REAL_MODEL, input=text, max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True}) | fields
    )


def assert_no_transaction(cluster: EmbeddedCluster) -> None:
    for node in cluster.nodes:
        with node.client() as client:
            commands = client.info("commandstats")
        assert "cmdstat_multi" not in commands and "cmdstat_exec" not in commands, sorted(commands)


def assert_response_keys_at_home(cluster: EmbeddedCluster) -> list[str]:
    """Every key of responses carries the home shard's tag: one slot of one node holds them all."""
    home = shard_layout(cluster.url).home
    keys = [key for key in cluster.all_keys("lmq:*") if ":response" in key]
    assert keys, "no response keys at all"
    assert {key_slot(key.encode()) for key in keys} == {key_slot(home.key("responses-active").encode())}, keys
    return keys


async def test_stored_responses_chain_list_and_delete_on_a_cluster(url, cluster):
    client = sdk(url)
    first = await client.responses.create(**turn("Name a colour."))
    second = await client.responses.create(**turn("And another?", previous_response_id=first.id))
    third = await client.responses.create(**turn("One more?", previous_response_id=second.id))
    assert first.status == second.status == third.status == "incomplete" and first.usage.output_tokens == 4
    assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens  # each continues the last
    assert third.previous_response_id == second.id
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text
    items = await client.responses.input_items.list(third.id, order="asc")
    assert [item.content[0].text for item in items.data] == ["One more?"]

    await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(**turn("Again?", previous_response_id=first.id))
    fourth = await client.responses.create(**turn("Again?", previous_response_id=third.id))  # its history is its own
    assert fourth.usage.input_tokens > third.usage.input_tokens

    keys = assert_response_keys_at_home(cluster)
    home = shard_layout(cluster.url).home
    assert home.key(f"response:{first.id}") not in keys and home.key(f"response:{fourth.id}") in keys
    redis = connect(cluster.url)
    try:
        assert 0 < await redis.ttl(home.key(f"response:{fourth.id}")) <= TTL_S
    finally:
        await redis.aclose()
    assert_no_transaction(cluster)


async def test_a_background_response_runs_to_its_end_on_a_cluster(url, cluster):
    client = sdk(url)
    queued = await client.responses.create(**turn("Count to ten.", background=True, max_output_tokens=8))
    assert queued.status == "queued"

    async def ended():
        found = await client.responses.retrieve(queued.id)
        return found if found.status not in ("queued", "in_progress") else None

    done = await poll(ended, what="the background response's end")
    assert done.status == "incomplete" and done.usage.output_tokens == 8
    events = [event async for event in await client.responses.retrieve(queued.id, stream=True)]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.output_text
    follow_up = await client.responses.create(**turn("Go on.", previous_response_id=queued.id))
    assert follow_up.usage.input_tokens > done.usage.input_tokens

    redis = connect(cluster.url)
    store = ResponseStore(redis, shard_layout(cluster.url).home, TTL_S)
    try:
        assert queued.id not in await store.active()  # it ended: no gateway drives it
        assert not await redis.exists(store.reply_stream(queued.id))  # the worker's reply stream is gone
        assert 0 < await redis.ttl(store.key(queued.id, "events")) <= TTL_S
    finally:
        await redis.aclose()
    assert_response_keys_at_home(cluster)
    await client.responses.delete(queued.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(queued.id)
    assert_no_transaction(cluster)
