"""Reading, claiming and keeping entries of the request stream, on a real Redis."""

from __future__ import annotations

import asyncio

from worker.claims import RequestStream

STREAM = "lmq:req:test"


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
    await asyncio.sleep(0.3)
    await holder.keep([kept.entry_id])
    claimed = await thief.claim_idle(min_idle_ms=200, count=10)
    assert [e.entry_id for e in claimed] == [abandoned.entry_id]
    assert claimed[0].fields == {b"msg": b"abandoned"}
    assert await thief.delivery_count(abandoned.entry_id) == 2
    assert await holder.delivery_count(kept.entry_id) == 1

