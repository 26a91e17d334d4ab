"""Reading, claiming and keeping entries of the request stream, on a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol import REQUEST_GROUP
from worker.claims import RequestStream, is_missing_group

STREAM = "lmq:req:test"
HOUR_MS = 3_600_000
CLAIM_IDLE_MS = 60_000  # far above any pause between two commands, far below an hour


async def test_read_new_gives_each_entry_to_one_consumer(redis_client):
    first, second = RequestStream(redis_client, STREAM, "w1"), RequestStream(redis_client, STREAM, "w2")
    await first.ensure_group()
    await second.ensure_group()  # BUSYGROUP is not an error
    for i in range(3):
        await redis_client.xadd(STREAM, {"msg": str(i)})
    got_first = await first.read_new(count=2, block_ms=100)
    got_second = await second.read_new(count=5, block_ms=100)
    assert [e.fields[b"msg"] for e in got_first] == [b"0", b"1"]
    assert [e.fields[b"msg"] for e in got_second] == [b"2"]
    assert await first.read_new(count=1, block_ms=10) == []


async def test_idle_entries_are_claimed_unless_kept(redis_client):
    holder, thief = RequestStream(redis_client, STREAM, "w1"), RequestStream(redis_client, STREAM, "w2")
    await holder.ensure_group()
    await redis_client.xadd(STREAM, {"msg": "kept"})
    await redis_client.xadd(STREAM, {"msg": "abandoned"})
    kept, abandoned = await holder.read_new(count=2, block_ms=100)
    # Both entries were last delivered an hour ago (XCLAIM's IDLE backdates them; JUSTID leaves their
    # delivery counts alone). Sleeping past a short claim time instead made the verdict depend on the
    # machine: a pause longer than that claim time between keep and claim let the kept entry go too.
    await redis_client.xclaim(
        STREAM, REQUEST_GROUP, "w1", 0, [kept.entry_id, abandoned.entry_id], idle=HOUR_MS, justid=True
    )
    await holder.keep([kept.entry_id])
    claimed = await thief.claim_idle(min_idle_ms=CLAIM_IDLE_MS, count=10)
    assert [e.entry_id for e in claimed] == [abandoned.entry_id]
    assert claimed[0].fields == {b"msg": b"abandoned"}
    assert await thief.delivery_count(abandoned.entry_id) == 2
    assert await holder.delivery_count(kept.entry_id) == 1


async def test_a_withdrawn_entry_is_acknowledged_not_run(any_redis_url):
    """Deleted while pending at a dead worker (the client left): Redis 6.2's XAUTOCLAIM answers (nil, nil)."""
    redis = aioredis.Redis.from_url(any_redis_url)
    dead, live = RequestStream(redis, STREAM, "dead"), RequestStream(redis, STREAM, "live")
    await dead.ensure_group()
    withdrawn = (await redis.xadd(STREAM, {"msg": "withdrawn"})).decode()
    await redis.xadd(STREAM, {"msg": "runnable"})
    await dead.read_new(count=2, block_ms=100)
    await redis.xdel(STREAM, withdrawn)
    await asyncio.sleep(0.05)
    claimed = await live.claim_idle(min_idle_ms=10, count=10)
    assert [e.fields for e in claimed] == [{b"msg": b"runnable"}]
    pending = await redis.xpending_range(STREAM, REQUEST_GROUP, min="-", max="+", count=10)
    assert [p["message_id"].decode() for p in pending] == [claimed[0].entry_id]
    await redis.aclose()


async def test_keeping_never_takes_an_entry_back_from_its_new_owner(any_redis_url):
    """A worker that stalled past the claim time and woke up learns it lost the entry."""
    redis = aioredis.Redis.from_url(any_redis_url)
    stale = RequestStream(redis, STREAM, "stale")
    await stale.ensure_group()
    await redis.xadd(STREAM, {"msg": "a"})
    await redis.xadd(STREAM, {"msg": "b"})
    taken, still_mine = await stale.read_new(count=2, block_ms=100)
    await asyncio.sleep(0.05)
    await redis.xclaim(STREAM, REQUEST_GROUP, "new", 10, [taken.entry_id])
    assert await stale.keep([taken.entry_id, still_mine.entry_id]) == [taken.entry_id]
    owners = {
        p["message_id"].decode(): p["consumer"]
        for p in await redis.xpending_range(STREAM, REQUEST_GROUP, min="-", max="+", count=10)
    }
    assert owners == {taken.entry_id: b"new", still_mine.entry_id: b"stale"}
    await redis.aclose()


async def test_a_read_takes_what_is_new_and_says_the_newest_id_and_whether_anything_is_left(any_redis_url):
    """One script call on Redis 6.2 and Valkey 9: `drained` is what lets a reader wait beyond `newest`."""
    redis = aioredis.Redis.from_url(any_redis_url)
    reader = RequestStream(redis, STREAM, "w1")
    await reader.ensure_group()
    empty = await reader.read_available(4)
    assert (empty.entries, empty.newest, empty.drained) == ([], "0-0", True)
    ids = [(await redis.xadd(STREAM, {"msg": str(i)})).decode() for i in range(3)]
    first = await reader.read_available(2)
    assert [e.fields for e in first.entries] == [{b"msg": b"0"}, {b"msg": b"1"}]
    assert (first.newest, first.drained) == (ids[2], False)
    rest = await reader.read_available(2)
    assert ([e.entry_id for e in rest.entries], rest.newest, rest.drained) == ([ids[2]], ids[2], True)
    pending = await redis.xpending_range(STREAM, REQUEST_GROUP, min="-", max="+", count=10, consumername="w1")
    assert [p["message_id"].decode() for p in pending] == ids
    await redis.aclose()


async def test_a_read_up_to_an_id_takes_no_newer_entry_and_says_what_is_left(any_redis_url):
    """What a reader of another worker's shard does (worker/affinity.py): only entries that were there
    when it began its wait, the oldest undelivered first, whoever took the ones before."""
    redis = aioredis.Redis.from_url(any_redis_url)
    own, other = RequestStream(redis, STREAM, "own"), RequestStream(redis, STREAM, "other")
    await own.ensure_group()
    ids = [(await redis.xadd(STREAM, {"msg": str(i)})).decode() for i in range(4)]
    assert [e.entry_id for e in (await own.read_available(1)).entries] == ids[:1]  # the shard's own worker
    before_wait = ids[2]
    read = await other.read_available(4, up_to=before_wait)
    assert ([e.entry_id for e in read.entries], read.newest, read.drained) == (ids[1:3], ids[3], False)
    nothing = await other.read_available(4, up_to=before_wait)
    assert (nothing.entries, nothing.drained) == ([], False), "the newer entry is still there, undelivered"
    assert [e.entry_id for e in (await other.read_available(4, up_to=ids[3])).entries] == ids[3:]
    assert (await other.read_available(4, up_to=ids[3])).drained
    await redis.xdel(STREAM, *ids)  # finished entries are deleted: the group's last id outlives them
    later = (await redis.xadd(STREAM, {"msg": "later"})).decode()
    assert [e.entry_id for e in (await other.read_available(4, up_to=later)).entries] == [later]
    await redis.aclose()


@pytest.mark.parametrize("up_to", [None, "0-0"])
async def test_a_read_of_a_lost_stream_or_group_answers_nogroup_as_xreadgroup_does(any_redis_url, up_to):
    """The worker recreates the group on NOGROUP (a FLUSHALL, a Redis restarted empty): the script must say so."""
    redis = aioredis.Redis.from_url(any_redis_url)
    reader = RequestStream(redis, STREAM, "w1")
    with pytest.raises(ResponseError) as missing_stream:
        await reader.read_available(1, up_to)
    await redis.xadd(STREAM, {"msg": "no group"})
    with pytest.raises(ResponseError) as missing_group:
        await reader.read_available(1, up_to)
    assert is_missing_group(missing_stream.value) and is_missing_group(missing_group.value)
    await redis.aclose()


async def test_waiting_beyond_a_mark_answers_the_first_newer_entry_or_none(redis_client):
    reader = RequestStream(redis_client, STREAM, "w1")
    await reader.ensure_group()
    mark = (await redis_client.xadd(STREAM, {"msg": "old"})).decode()
    assert await reader.wait_beyond(mark, 10) is None
    newer = [(await redis_client.xadd(STREAM, {"msg": str(i)})).decode() for i in range(2)]
    assert await reader.wait_beyond(mark, 10) == newer[0]
    assert (await reader.read_available(4)).newest == newer[1], "waiting took nothing"
