"""Reading, claiming and keeping entries of the request stream, on a real Redis."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from protocol import REQUEST_GROUP
from worker.claims import RequestStream

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
