"""worker/affinity.py: which lanes a worker reads, and that another's shard is read only after its own worker had the chance."""

from __future__ import annotations

import time

from protocol.keys import sharded
from worker import affinity
from worker.affinity import ShardAffinity
from worker.claims import model_lanes


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
