"""worker/affinity.py: which lanes a worker reads, and that another's shard is read only after its own worker had the chance."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import redis.asyncio as aioredis

import protocol
from protocol import Heartbeat
from protocol.keys import sharded
from protocol.redis_client import CLUSTER_SOCKET_TIMEOUT_S
from tests.support.worker_harness import MODEL, chat_request, stop_worker, wait_for, worker_config
from worker import affinity, service
from worker.affinity import ShardAffinity
from worker.claims import model_lanes
from worker.service import Worker


def two_worker_affinity(worker: str = "w1") -> ShardAffinity:
    layout = sharded(4)
    lanes = {lane.name: lane for lane in model_lanes(layout, "m")}
    shards = ShardAffinity(lanes, 4, worker)
    shards.assign(["w1", "w2"])
    return shards


def test_each_of_two_workers_prefers_half_of_the_shards():
    assert two_worker_affinity("w1").preferred == {0, 2}
    assert two_worker_affinity("w2").preferred == {1, 3}


def test_another_s_shard_is_read_only_while_every_own_lane_of_its_priority_found_nothing():
    shards = two_worker_affinity()
    assert shards.may_read("interactive@1")  # nothing read yet: every lane counts as empty
    shards.found("interactive", True)
    assert not shards.may_read("interactive@1") and shards.may_read("interactive@2")
    assert shards.may_read("batch@1"), "the batch lanes are judged by the batch lanes alone"
    shards.found("interactive", False)
    assert shards.may_read("interactive@1")


async def test_reading_another_s_shard_waits_defer_s_and_an_own_shard_not_at_all():
    shards = two_worker_affinity()
    started = time.perf_counter()
    await shards.defer("interactive@2")
    own = time.perf_counter() - started
    await shards.defer("interactive@1")
    other = time.perf_counter() - started - own
    assert own < affinity.DEFER_S / 2 and other >= affinity.DEFER_S * 0.9, (own, other)


async def test_a_reader_of_another_s_shard_takes_only_entries_that_were_there_before_its_wait(
    tiny, redis_url, redis_client, monkeypatch
):
    """The deferral leaves a new entry to its shard's own worker; what the reader takes after it must be
    what waited through it (a backlog), not also what arrived during it: each entry taken that way
    makes every step of its request write one more shard. Here shard 1 belongs to `w2`, which never
    reads (full, stopped or gone), so w1 must still take both of its entries: B one wait after A."""
    layout, redis, worker = await w1_beside_w2(tiny, redis_url, redis_client, monkeypatch)
    foreign = layout.shards[1]
    stream = foreign.request_stream(MODEL)

    before_wait: dict[str, set[str]] = {}  # lane -> the stream's entries when its reader's last wait began
    added_b: list[str] = []
    defer, admit_all = worker.affinity.defer, worker._admit_all

    async def watched_defer(lane: str) -> None:
        if not worker.affinity.preferred_lane(lane):
            ids = {entry_id.decode() for entry_id, _ in await redis.xrange(worker.stream.lanes[lane].stream)}
            before_wait[lane] = ids
            if lane == "interactive@1" and ids and not added_b:  # A is there: B arrives during this wait
                added_b.append((await redis.xadd(stream, {"msg": request("b", foreign).encode()})).decode())
        await defer(lane)

    taken: list[tuple[str, str, bool]] = []  # (lane, entry id, there when the wait before its read began)

    async def watched_admit_all(entries, *, claimed):
        for entry in entries:
            lane = entry.ref.lane
            if not claimed and not worker.affinity.preferred_lane(lane):
                taken.append((lane, entry.entry_id, entry.entry_id in before_wait.get(lane, set())))
        await admit_all(entries, claimed=claimed)

    monkeypatch.setattr(worker.affinity, "defer", watched_defer)
    monkeypatch.setattr(worker, "_admit_all", watched_admit_all)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_for(lambda: readers_waiting(redis_client, len(worker.stream.lanes)), what="every reader waiting")
        a = (await redis_client.xadd(stream, {"msg": request("a", foreign).encode()})).decode()

        async def both_served() -> bool:
            return len(taken) == 2 and await redis_client.xlen(stream) == 0

        await wait_for(both_served, what="both entries of the other worker's shard taken and finished")
    finally:
        await stop_worker(task, stop, 30.0)
        await redis.aclose()
    assert [entry_id for _, entry_id, _ in taken] == [a, *added_b]
    assert all(waited for _, _, waited in taken), f"taken in the read right after the wait it arrived in: {taken}"


async def test_a_reader_of_another_s_shard_waits_watch_block_ms_for_a_new_entry_not_a_second(
    tiny, redis_url, redis_client, monkeypatch
):
    """A reader with nothing to read waits for a new entry in an XREAD that ends the moment one arrives;
    its timeout only says when to look again, and each look is a read script and a new XREAD. Own lanes
    look every second; another's shard brings nothing without a new entry, so its readers (a worker
    has K - 1 shards' of them) wait WATCH_BLOCK_MS: with nothing arriving, none reads again in 2.5 s. On a
    cluster that wait must end before the client's socket timeout, or it fails as a broken connection."""
    _, redis, worker = await w1_beside_w2(tiny, redis_url, redis_client, monkeypatch)
    reads: list[str] = []
    read_available = worker.stream.read_available

    async def counted_read(lane, slots, up_to=None):
        reads.append(lane)
        return await read_available(lane, slots, up_to)

    monkeypatch.setattr(worker.stream, "read_available", counted_read)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_for(lambda: readers_waiting(redis_client, len(worker.stream.lanes)), what="every reader waiting")
        reads.clear()
        await asyncio.sleep(2.5)
    finally:
        await stop_worker(task, stop, 30.0)
        await redis.aclose()
    assert 2_500 < affinity.WATCH_BLOCK_MS <= CLUSTER_SOCKET_TIMEOUT_S * 1000 - 1000
    assert reads.count("interactive") >= 2, f"own lanes look again every second: {reads}"
    assert reads.count("interactive@1") == reads.count("batch@1") == 0, f"another's shard looked again: {reads}"


async def w1_beside_w2(model, redis_url: str, redis_client: aioredis.Redis, monkeypatch):
    """Two shards on one Redis and worker w1 (not started), which prefers shard 0 because w2's heartbeat
    says w2 serves the model too (w2 itself never runs): (the layout, w1's client, w1)."""
    layout = sharded(2)
    monkeypatch.setattr(service, "shard_layout", lambda url: layout)
    beat = Heartbeat(worker_id="w2", model=MODEL, capacity=4, running=0, waiting=0, kv_pages_used=0,
                     kv_pages_total=1, time=time.time())  # fmt: skip
    await redis_client.set(layout.home.worker_key("w2"), beat.encode(), ex=600)
    redis = aioredis.Redis.from_url(redis_url)
    worker = Worker(worker_config(redis_url, "w1"), model, redis)
    worker.affinity.assign(["w1", "w2"])
    assert worker.affinity.preferred == {0}
    return layout, redis, worker


async def readers_waiting(redis: aioredis.Redis, count: int) -> bool:
    """Whether `count` clients are blocked in an XREAD (a worker's lane readers, each waiting for a new entry)."""
    return sum(client["cmd"] == "xread" and "b" in client["flags"] for client in await redis.client_list()) >= count


def request(request_id: str, shard) -> protocol.Request:
    """A greedy request of a few tokens whose events go to a reply stream in `shard`'s slot."""
    return dataclasses.replace(
        chat_request(request_id, max_tokens=4), reply=protocol.Reply("stream", shard.key(f"reply:test:{request_id}"))
    )
