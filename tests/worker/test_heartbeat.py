"""The heartbeat key: refreshed while the worker lives, gone when it stops."""

from __future__ import annotations

import asyncio

from protocol import Heartbeat, worker_key
from tests.support.worker_harness import TIMEOUT_S, wait_for
from worker.heartbeat import heartbeat_loop


async def test_heartbeat_key_lives_while_the_loop_runs(redis_client):
    beat = Heartbeat("w1", "m", capacity=4, running=1, waiting=0, kv_pages_used=3, kv_pages_total=10, time=1.0)
    task = asyncio.create_task(heartbeat_loop(redis_client, "w1", lambda: beat))
    await wait_for(lambda: redis_client.exists(worker_key("w1")), what="the first heartbeat")
    assert Heartbeat.decode(await redis_client.get(worker_key("w1"))) == beat
    assert 0 < await redis_client.ttl(worker_key("w1")) <= 10
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=TIMEOUT_S)
    assert done, f"the heartbeat loop still runs {TIMEOUT_S} s after its cancellation"
    assert not await redis_client.exists(worker_key("w1"))
