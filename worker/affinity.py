"""Shard affinity on a Redis Cluster: each worker prefers a few shards and reads the others only when
its own have nothing for it.

Why: a worker writes each step with one script call per shard its running requests came from
(worker/publisher.py). A worker that reads every shard alike holds requests of all K shards and pays
K calls a step, and a cluster's nodes spend most of their time on the fixed cost of each call. With
W workers each preferring K/W shards, a loaded worker's requests come from its own shards, and a
step costs about K/W calls.

Which shards: the live workers of the model (their heartbeats, read every few seconds), sorted by
id; the one ranked r of W prefers the shards k with k mod W = r (shard r mod K when W >= K). Until
it has read them, or on one Redis (one shard), a worker prefers every shard.

What stays: the pull model's load balancing. A worker's reader on another's shard reads as soon as
every one of the worker's own lanes of that priority found nothing at its last read, so a worker
whose shards are empty takes from a backlog anywhere, and no worker idles while another has one.

Why another's shard is read DEFER_S late: a pull reader drains its stream at every read, so "found
nothing" is the normal state of an own lane, and a worker with free slots would race the shard's
own worker for every new entry: with W >= K workers each one's steps would touch every shard,
though every shard has a worker waiting on it. Reading another's shard only DEFER_S after it
showed a new entry leaves that entry to its own worker (blocked on that stream, it reads in well
under a millisecond), and what is still there after DEFER_S is a backlog: the shard's worker is
full, stopped or gone. The read after the deferral takes only entries no newer than the newest id
its reader knew of before the deferral began (`up_to`): one that arrived during it, a millisecond
before the read, is not yet a backlog, and taking it would make every step of its request write
one more shard. So no worker idles for more than about two deferrals while another has a backlog:
an entry that arrives during one is taken after the next.

Why a reader of another's shard waits WATCH_BLOCK_MS in one XREAD where an own lane's waits a second: a
reader with nothing to read waits for a new entry with an XREAD that returns the moment one arrives;
its timeout only says when to look again, and each look costs a read script and a new XREAD. A worker
reads every shard at both priorities, so with W workers and K shards W × 2K readers looked every
second: 6 workers on 6 shards, 72 readers, whose looks were more than half of the cluster's reads and
waits per token at saturation (docs/benchmarks.md, "The cluster at saturation"). Nothing a reader of
another's shard waits for comes without a new entry (its backlog is entries its own worker leaves; a
dead worker's pending entries are the claim loop's), so it looks only every WATCH_BLOCK_MS: 4 s, short
of the cluster client's socket timeout (5 s), past which the read would fail as a broken connection.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from protocol import Heartbeat, ProtocolError
from protocol.keys import Shard
from protocol.redis_client import REDIS_FAILURES
from worker.claims import Lane

log = logging.getLogger(__name__)

FOLLOW_INTERVAL_S = 5.0
DEFER_S = 0.05  # how long a new entry in another's shard is left to that shard's own worker
WATCH_BLOCK_MS = 4_000  # how long a reader of another's shard waits for a new entry before looking again


class ShardAffinity:
    def __init__(self, lanes: dict[str, Lane], shard_count: int, worker_id: str):
        self.lanes = lanes
        self.shard_count = shard_count
        self.worker_id = worker_id
        self.preferred = frozenset(range(shard_count))
        self._found_nothing = dict.fromkeys(lanes, True)  # lane name -> its last read found nothing
        self._changed = asyncio.Event()

    def assign(self, live: list[str]) -> None:
        """Prefer this worker's share of the shards among `live` (the workers of the model, any order)."""
        ranked = sorted(set(live) | {self.worker_id})
        rank, count = ranked.index(self.worker_id), len(ranked)
        if count >= self.shard_count:
            preferred = frozenset({rank % self.shard_count})
        else:
            preferred = frozenset(k for k in range(self.shard_count) if k % count == rank)
        if preferred != self.preferred:
            log.info("worker %s prefers shards %s of %d", self.worker_id, sorted(preferred), self.shard_count)
            self.preferred = preferred
            self._wake()

    def may_read(self, lane: str) -> bool:
        """A lane of a preferred shard always; another only while every own lane of its priority is empty."""
        this = self.lanes[lane]
        if self.preferred_lane(lane):
            return True
        return all(
            self._found_nothing[name]
            for name, other in self.lanes.items()
            if other.priority == this.priority and other.shard.index in self.preferred
        )

    def preferred_lane(self, lane: str) -> bool:
        return self.lanes[lane].shard.index in self.preferred

    def block_ms(self, lane: str, own_ms: int) -> int:
        """How long `lane`'s reader waits for a new entry in one XREAD: `own_ms` on a preferred shard."""
        return own_ms if self.preferred_lane(lane) else WATCH_BLOCK_MS

    def up_to(self, lane: str, seen: str) -> str | None:
        """The newest entry the next read of `lane` may take, given `seen`, the newest entry id its reader
        knew of before the deferral that precedes that read: on a preferred shard any (None); on another's
        only those, which have waited a deferral (DEFER_S) for their own worker."""
        return None if self.preferred_lane(lane) else seen

    async def defer(self, lane: str) -> None:
        """Before reading another's shard: DEFER_S, for its own worker to take what is new."""
        if not self.preferred_lane(lane):
            await asyncio.sleep(DEFER_S)

    def found(self, lane: str, anything: bool) -> None:
        """What a lane's last read found; a lane of ours found empty may let another shard's reader go."""
        was_empty = self._found_nothing[lane]
        self._found_nothing[lane] = not anything
        if not anything and not was_empty:
            self._wake()

    async def changed(self) -> None:
        """Until the preferred shards change or one of their lanes is found empty."""
        await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, redis: aioredis.Redis, home: Shard, model: str) -> None:
        """Re-read the live workers of `model` every FOLLOW_INTERVAL_S, and prefer accordingly."""
        while True:
            try:
                self.assign(await live_workers(redis, home, model))
            except REDIS_FAILURES as exc:
                log.debug("could not read the live workers: %s", exc)
            await asyncio.sleep(FOLLOW_INTERVAL_S)


async def live_workers(redis: aioredis.Redis, home: Shard, model: str) -> list[str]:
    """The ids of the workers whose heartbeat says they serve `model`."""
    keys = [key async for key in redis.scan_iter(match=f"{home.worker_key_prefix}*", count=1000)]
    live = []
    for raw in await redis.mget(keys) if keys else []:
        if raw is None:
            continue
        try:
            beat = Heartbeat.decode(raw)
        except ProtocolError:
            continue
        if beat.model == model:
            live.append(beat.worker_id)
    return live
