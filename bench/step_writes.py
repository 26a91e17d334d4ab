"""What a worker step's Redis writes cost: the fenced step script (worker/step_script.py) beside the
plain MULTI/EXEC it replaced (PUBLISH + a progress RPUSH per request), same server, same run.

    .venv/bin/python -m bench.step_writes [--requests 16] [--steps 300]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time

import redis.asyncio as aioredis

from lmq.redis_server import EmbeddedRedis
from protocol import REQUEST_GROUP, Reply, delta_event, encode_event_batch, progress_key
from protocol.keys import INTERACTIVE
from worker.claims import Lane
from worker.publisher import Publisher

STREAM = "lmq:req:bench"
CHANNEL = "lmq:reply:bench"


async def measure(redis: aioredis.Redis, requests: int, steps: int) -> tuple[float, float]:
    await redis.xgroup_create(STREAM, REQUEST_GROUP, id="0", mkstream=True)
    entries = [(await redis.xadd(STREAM, {"msg": b"x"})).decode() for _ in range(requests)]
    await redis.xreadgroup(REQUEST_GROUP, "w1", {STREAM: ">"}, count=requests)
    publisher = Publisher(redis, [Lane(INTERACTIVE, STREAM)], "w1")
    script, multi = [], []
    for step in range(steps):
        events = [delta_event(f"r{i}", step, "tok", [step], step) for i in range(requests)]
        for entry_id, event in zip(entries, events):
            publisher.send(entry_id, Reply("pubsub", CHANNEL), event)
            publisher.record_progress(entry_id, event["id"], step, [step])
        writes, publisher._pending = publisher._pending, {}
        started = time.perf_counter()
        await publisher._send(writes)
        script.append(time.perf_counter() - started)
        started = time.perf_counter()
        pipe = redis.pipeline(transaction=True)
        pipe.publish(CHANNEL, encode_event_batch(events))
        for event in events:
            pipe.rpush(progress_key("old-" + event["id"]), step)
            pipe.expire(progress_key("old-" + event["id"]), 3600)
        await pipe.execute()
        multi.append(time.perf_counter() - started)
    return statistics.median(script), statistics.median(multi)


async def main(args: argparse.Namespace) -> None:
    with EmbeddedRedis() as server:
        redis = aioredis.Redis.from_url(server.url)
        try:
            script, multi = await measure(redis, args.requests, args.steps)
        finally:
            await redis.aclose()
    print(
        f"{platform.processor() or platform.machine()}, {server.name} {server.version}, {args.requests} requests a step, median of {args.steps}:"
    )
    print(f"  fenced step script {script * 1e3:.2f} ms   MULTI/EXEC {multi * 1e3:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    asyncio.run(main(parser.parse_args()))
