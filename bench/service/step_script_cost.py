"""What the step script costs Redis per call and per record, and what its parts cost: variants side by side.

    python bench/service/step_script_cost.py --records 1,8,32 --calls 3000 --rounds 3 [--server valkey|redis6]

One embedded Redis, one consumer holding 300 pending entries, and the real Publisher sending steps of
n records (a delta event to a pub/sub reply channel, the progress record) through worker/step_script.py.
Redis's own CPU seconds (INFO used_cpu_sys + used_cpu_user) per call, for each variant in turn, the
order reversed every other round (this machine's load drifts). The variants:

- `script`: the step script as it is.
- `set-get`: its retry fence in one command, `SET ... GET` (Redis 6.2+), in place of a GET then a SET.
- `no-ownership-check`: every record taken as owned, no XPENDING: NOT SAFE (a worker that lost its
  entry would write for it); measured only to say what the per-record ownership check costs.

From two record counts the cost splits into a part per call and a part per record (least squares).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis
import redis.asyncio as aioredis

from bench.service.serve import int_list
from lmq.redis_server import EmbeddedRedis, find_redis_server
from protocol import REQUEST_GROUP, Reply, delta_event
from protocol.keys import UNSHARDED
from worker import step_script
from worker.claims import EntryRef, Lane
from worker.publisher import Publisher

ENTRIES = 300
STEP_FENCE = "local last = tonumber(redis.call('GET', applied_key) or '-1')\nif last >= step then return {} end\nredis.call('SET', applied_key, step, 'EX', ttl)\n"
ONE_COMMAND_FENCE = "local last = tonumber(redis.call('SET', applied_key, step, 'GET', 'EX', ttl) or '-1')\nif last >= step then return {} end\n"
OWNER_CHECK = "local who = owner(r.stream, r.entry)"


def variants() -> dict[str, str]:
    lua = step_script.LUA
    if STEP_FENCE not in lua or OWNER_CHECK not in lua:
        raise RuntimeError("the step script changed: update this benchmark's variants")
    return {
        "script": lua,
        "set-get": lua.replace(STEP_FENCE, ONE_COMMAND_FENCE),
        "no-ownership-check": lua.replace(OWNER_CHECK, "local who = me"),
    }


def redis_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return info["used_cpu_sys"] + info["used_cpu_user"]


async def cpu_per_call(client: aioredis.Redis, sync: redis.Redis, lane: Lane, entries: list[str], lua: str,
                       records: int, calls: int) -> float:  # fmt: skip
    """Redis CPU µs per step-script call of `records` records."""
    publisher = Publisher(client, [lane], "w")
    publisher._script = client.register_script(lua)
    reply = Reply("pubsub", "lmq:reply:bench")
    before = redis_cpu_s(sync)
    for step in range(calls):
        for k in range(records):
            entry = EntryRef(lane.name, entries[k])
            publisher.send(entry, reply, delta_event(f"r{k}", step, "tok", [step], step))
            publisher.record_progress(entry, f"r{k}", step, [step])
        writes, publisher._pending = publisher._pending, {}
        await publisher._send(writes)
    return (redis_cpu_s(sync) - before) / calls * 1e6


def split(costs: dict[int, float]) -> tuple[float, float]:
    """Least squares of cost = per_call + n × per_record over the record counts."""
    ns = list(costs)
    mean_n, mean_c = sum(ns) / len(ns), sum(costs.values()) / len(ns)
    slope = sum((n - mean_n) * (costs[n] - mean_c) for n in ns) / max(sum((n - mean_n) ** 2 for n in ns), 1e-9)
    return mean_c - slope * mean_n, slope


async def run(args: argparse.Namespace) -> None:
    server = EmbeddedRedis(server=find_redis_server(args.server)).start()
    sync = redis.Redis.from_url(server.url)
    client = aioredis.Redis.from_url(server.url)
    try:
        lane = Lane("interactive", UNSHARDED.request_stream("m"))
        sync.xgroup_create(lane.stream, REQUEST_GROUP, id="0", mkstream=True)
        for _ in range(ENTRIES):
            sync.xadd(lane.stream, {"msg": b"x" * 200})
        reply = sync.xreadgroup(REQUEST_GROUP, "w", {lane.stream: ">"}, count=ENTRIES)
        entries = [entry_id.decode() for entry_id, _ in reply[0][1]]
        print(f"{server.name} {server.version}; Redis CPU µs per step-script call", flush=True)
        costs: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.records} for name in variants()}
        for round_number in range(args.rounds):
            order = list(variants().items())
            for name, lua in order if round_number % 2 == 0 else reversed(order):
                for n in args.records:
                    calls = max(args.calls // n, 100)
                    costs[name][n].append(await cpu_per_call(client, sync, lane, entries, lua, n, calls))
        for name, by_n in costs.items():
            medians = {n: sorted(values)[len(values) // 2] for n, values in by_n.items()}
            per_call, per_record = split(medians)
            cells = "  ".join(f"n={n}: {medians[n]:6.1f} ({', '.join(f'{v:.0f}' for v in by_n[n])})" for n in by_n)
            print(f"{name:>20}  {cells}   → {per_call:5.1f} µs per call + {per_record:5.2f} µs per record")
    finally:
        await client.aclose()
        sync.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int_list, default=[1, 8, 32], help="records per call, e.g. 1,8,32")
    parser.add_argument("--calls", type=int, default=3000, help="records sent per measurement (calls × records)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server", default=None, help="redis6 or valkey (default: what find_redis_server finds)")
    args = parser.parse_args(argv)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
