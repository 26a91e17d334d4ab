"""`REDIS_URL=redis+cluster://...` and the shard layout it implies, without a server.

The URL's forms and the errors of a wrong one (protocol/cluster_url.py: ValueErrors that name the
problem and never show a password, refused at start-up by lmq/checks.py); the key names of
protocol/keys.py: the single-Redis names unchanged, K hash-tagged shards whose tags put shard k
in the k-th of K equal slot ranges (so that they spread evenly over primaries that split the
slots evenly, as `redis-cli --cluster create` does), every key of a shard in its slot, and a
request's shard fixed by crc32 of its id, as docs/protocol.md tells foreign producers.
"""

from __future__ import annotations

import functools
import zlib
from collections import Counter

import pytest
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from gateway.config import GatewayConfig
from lmq.checks import check_gateway, check_worker
from lmq.redis_cluster import cli_slot_ranges
from lmq.serve import redacted
from protocol import keys
from protocol.cluster_url import DEFAULT_SHARDS, ClusterAddress, is_cluster_url, parse_cluster_url, shard_layout
from protocol.keys import SINGLE, UNSHARDED, sharded
from worker.config import WorkerConfig

PASSWORD = "s3cret-pw"

# ---------------------------------------------------------------- the URL


@pytest.mark.parametrize(
    "url, address",
    [
        ("redis+cluster://10.0.0.1:7000", ClusterAddress((("10.0.0.1", 7000),))),
        (
            "redis+cluster://h1:7000,h2:7001,[::1]:7002/",
            ClusterAddress((("h1", 7000), ("h2", 7001), ("::1", 7002))),
        ),
        ("redis+cluster://h:7000/?shards=6", ClusterAddress((("h", 7000),), shards=6)),
        ("redis+cluster://h:7000?shards=1", ClusterAddress((("h", 7000),), shards=1)),
        ("redis+cluster://h:7000/?shards=1024", ClusterAddress((("h", 7000),), shards=1024)),
        ("REDIS+CLUSTER://:p%40ss%2Fw@h:1", ClusterAddress((("h", 1),), password="p@ss/w")),
        (
            "redis+cluster://lmq:secret@h1:1,h2:2/?shards=3",
            ClusterAddress((("h1", 1), ("h2", 2)), 3, username="lmq", password="secret"),
        ),
        ("redis+cluster://lmq@h:1", ClusterAddress((("h", 1),), username="lmq")),
        ("redis+cluster://h:7000/#fragment", ClusterAddress((("h", 7000),))),
    ],
)
def test_a_cluster_url_names_nodes_shards_and_login(url, address):
    assert is_cluster_url(url)
    assert parse_cluster_url(url) == address


def test_the_default_is_twelve_shards():
    assert DEFAULT_SHARDS == 12
    assert parse_cluster_url("redis+cluster://h:7000").shards == 12
    assert len(shard_layout("redis+cluster://h:7000").shards) == 12


@pytest.mark.parametrize(
    "url, complaint",
    [
        (f"redis+cluster://:{PASSWORD}@h:7000/0", "no path"),
        (f"redis+cluster://:{PASSWORD}@h", "each node is HOST:PORT"),
        (f"redis+cluster://:{PASSWORD}@h:port", "each node is HOST:PORT"),
        (f"redis+cluster://:{PASSWORD}@h:70000", "each node is HOST:PORT"),
        (f"redis+cluster://:{PASSWORD}@h:0", "each node is HOST:PORT"),
        (f"redis+cluster://:{PASSWORD}@:7000", "each node is HOST:PORT"),
        (f"redis+cluster://:{PASSWORD}@", "each node is HOST:PORT"),
        (f"redis+cluster://:{PASSWORD}@h1:1,,h2:2", "each node is HOST:PORT"),
        (f"redis+cluster://:{PASSWORD}@[::1:7000", "each node is HOST:PORT"),
        (f"redis+cluster://:{PASSWORD}@[::1]7000", "each node is HOST:PORT"),
        (f"redis+cluster://:{PASSWORD}@h:1/?shards=0", "shards is one number from 1 to 1024"),
        (f"redis+cluster://:{PASSWORD}@h:1/?shards=1025", "shards is one number from 1 to 1024"),
        (f"redis+cluster://:{PASSWORD}@h:1/?shards=six", "shards is one number from 1 to 1024"),
        (f"redis+cluster://:{PASSWORD}@h:1/?shards=", "shards is one number from 1 to 1024"),
        (f"redis+cluster://:{PASSWORD}@h:1/?shards=-3", "shards is one number from 1 to 1024"),
        (f"redis+cluster://:{PASSWORD}@h:1/?shards=3&shards=6", "shards is one number"),
        (f"redis+cluster://:{PASSWORD}@h:1/?password={PASSWORD}", "unknown Redis Cluster URL option 'password'"),
        (f"redis+cluster://:{PASSWORD}@h:1/?{PASSWORD}", "name=value pairs"),
        (f"redis://:{PASSWORD}@h:1/0", "not a Redis Cluster URL"),
    ],
)
def test_a_wrong_cluster_url_says_what_is_wrong_without_the_password(url, complaint):
    with pytest.raises(ValueError, match=complaint) as failure:
        parse_cluster_url(url)
    assert PASSWORD not in str(failure.value)


def test_other_urls_are_not_cluster_urls_and_keep_the_single_redis_names():
    for url in ("redis://h:6379/0", "rediss://h/0", "unix:///tmp/r.sock?db=0", "redis+sentinel://h/m", "cluster://h:1"):
        assert not is_cluster_url(url)
        assert shard_layout(url) == SINGLE


def test_the_shard_count_of_the_url_gives_the_layout():
    assert shard_layout("redis+cluster://h:1,h:2/?shards=6") == sharded(6)


def test_a_wrong_cluster_url_is_refused_at_start_up_naming_the_setting():
    url = f"redis+cluster://:{PASSWORD}@h1:7000/?shards=0"
    for check, settings in ((check_gateway, GatewayConfig), (check_worker, WorkerConfig)):
        with pytest.raises(ValueError, match=r"^REDIS_URL \(--redis-url\): shards is one number") as failure:
            check(settings(redis_url=url))
        assert PASSWORD not in str(failure.value)
    check_gateway(GatewayConfig(redis_url="redis+cluster://h1:7000,h2:7001/?shards=6"))


def test_no_password_of_a_cluster_url_shows_in_messages():
    shown = redacted(f"redis+cluster://lmq:{PASSWORD}@h1:7000,h2:7001/?shards=6")
    assert PASSWORD not in shown
    assert shown.startswith("redis+cluster://lmq:***@h1:7000,h2:7001/") and "shards=6" in shown


# ---------------------------------------------------------------- one Redis: the classic names


def test_the_unsharded_layout_keeps_the_single_redis_names():
    shard = SINGLE.home
    assert SINGLE.shards == (UNSHARDED,) and shard.tag is None
    assert shard.request_stream("m:v1") == "lmq:req:m:v1"
    assert shard.request_stream("m", "batch") == "lmq:req-batch:m"
    assert shard.dead_letter_stream == "lmq:dead"
    assert shard.progress_key("r1") == "lmq:progress:r1"
    assert shard.holder_key("r1") == "lmq:holder:r1"
    assert shard.applied_step_key("w1", "t") == "lmq:applied:w1:t"
    assert shard.worker_key("w1") == "lmq:worker:w1"
    assert shard.batch_index("openai") == "lmq:batches:openai"
    assert shard.active_batches == "lmq:batches-active"
    assert shard.file_index == "lmq:files"
    assert shard.batch_key("b1", "items") == "lmq:batch:b1:items"
    assert shard.batch_reply_stream("b1", 3, 2) == "lmq:batch:b1:reply:3.2"
    assert shard.file_key("f1", "data") == "lmq:file:f1:data"
    assert all(SINGLE.for_request(f"id-{i}") is UNSHARDED for i in range(50))


def test_the_module_level_names_are_the_single_redis_ones():
    assert keys.request_stream("m") == "lmq:req:m"
    assert keys.request_stream("m", keys.BATCH) == "lmq:req-batch:m"
    assert keys.DEAD_LETTER_STREAM == "lmq:dead"
    assert keys.progress_key("r") == "lmq:progress:r"
    assert keys.holder_key("r") == "lmq:holder:r"
    assert keys.WORKER_KEY_PREFIX == "lmq:worker:" and keys.worker_key("w") == "lmq:worker:w"
    assert keys.ACTIVE_BATCHES == "lmq:batches-active" and keys.FILE_INDEX == "lmq:files"
    assert keys.gateway_reply_channel("g1") == "lmq:reply:g1"
    assert keys.CANCEL_CHANNEL == "lmq:cancel"


def test_an_unknown_priority_has_no_stream():
    with pytest.raises(ValueError, match="unknown priority"):
        sharded(3).home.request_stream("m", "urgent")


# ---------------------------------------------------------------- a cluster: K tagged shards


def _range(index: int, count: int) -> range:
    return range(index * REDIS_CLUSTER_HASH_SLOTS // count, (index + 1) * REDIS_CLUSTER_HASH_SLOTS // count)


def _slot(key: str) -> int:
    return key_slot(key.encode())


@pytest.mark.parametrize("count", [1, 2, 3, 5, 6, 12, 16, 64, 1024])
def test_shard_k_lies_in_the_kth_slot_range_with_every_key_of_it(count):
    layout = sharded(count)
    assert [shard.index for shard in layout.shards] == list(range(count))
    assert len({shard.tag for shard in layout.shards}) == count
    for shard in layout.shards:
        slot = _slot(f"{{{shard.tag}}}")
        assert slot in _range(shard.index, count), (shard, slot)
        names = [
            shard.request_stream("tiny"),
            shard.request_stream("org/model:q4", keys.BATCH),
            shard.dead_letter_stream,
            shard.progress_key("req-{odd}-id"),
            shard.holder_key("r1"),
            shard.applied_step_key("worker-1", "token"),
            shard.key("reply:myapp:r1"),
        ]
        assert all(name.startswith(f"lmq:{{{shard.tag}}}:") for name in names), names
        assert {_slot(name) for name in names} == {slot}, names


def _middle_half(index: int, count: int) -> range:
    low, high = index * REDIS_CLUSTER_HASH_SLOTS // count, (index + 1) * REDIS_CLUSTER_HASH_SLOTS // count
    quarter = (high - low) // 4
    return range(low + quarter, high - quarter)


@pytest.mark.parametrize("count", [1, 6, 12, 100])
def test_the_tags_are_the_ones_docs_protocol_md_describes(count):
    """T[k] is the first of "k.0", "k.1", ... whose slot lies in the middle half of the k-th range."""
    for shard in sharded(count).shards:
        attempt = next(a for a in range(1_000_000) if _slot(f"{shard.index}.{a}") in _middle_half(shard.index, count))
        assert shard.tag == f"{shard.index}.{attempt}"


def test_home_is_shard_zero_and_holds_the_heartbeats():
    layout = sharded(6)
    assert layout.home is layout.shards[0]
    assert layout.home.worker_key("w1") == f"lmq:{{{layout.home.tag}}}:worker:w1"
    assert _slot(layout.home.worker_key("w1")) == _slot(layout.home.request_stream("tiny"))


@pytest.mark.parametrize("count", [0, -1, 1025])
def test_a_shard_count_out_of_range_is_refused(count):
    with pytest.raises(ValueError, match="the number of shards is from 1 to 1024"):
        sharded(count)


def _floor_ranges(primaries: int) -> list[tuple[int, int]]:
    return [(r.start, r.stop - 1) for r in (_range(index, primaries) for index in range(primaries))]


@functools.cache
def _shard_slots(count: int) -> tuple[int, ...]:
    """The hash slot of each of `count` shards' tags (searched for by `sharded`: computed once per count)."""
    return tuple(_slot(f"{{{shard.tag}}}") for shard in sharded(count).shards)


def _shards_per_primary(count: int, ranges: list[tuple[int, int]]) -> Counter:
    owners = Counter()
    for slot in _shard_slots(count):
        owners[next(i for i, (first, last) in enumerate(ranges) if first <= slot <= last)] += 1
    return owners


def test_redis_cli_splits_three_primaries_with_rounded_ends():
    assert cli_slot_ranges(3) == [(0, 5460), (5461, 10922), (10923, 16383)]
    assert cli_slot_ranges(1) == [(0, 16383)]
    for primaries in range(1, 17):
        ranges = cli_slot_ranges(primaries)
        assert ranges[0][0] == 0 and ranges[-1][1] == REDIS_CLUSTER_HASH_SLOTS - 1
        assert all(ranges[i][1] + 1 == ranges[i + 1][0] for i in range(primaries - 1))


@pytest.mark.parametrize("count", [3, 6, 12, 24, 48, 96])
def test_three_primaries_serve_k_over_three_shards_each(count):
    for ranges in (cli_slot_ranges(3), _floor_ranges(3)):
        assert _shards_per_primary(count, ranges) == Counter({0: count // 3, 1: count // 3, 2: count // 3})


def test_k_shards_spread_evenly_over_any_primary_count_that_divides_k():
    """Every K up to 72 (and some larger) and every P up to 16 that divides it, with the slot ends
    rounded as redis-cli rounds them and floored: a tag at a range's end would fall to the
    neighbour in one. (All K to 1024 take minutes: sharded(1024) alone searches for 0.6 s.)"""
    uneven = []
    for count in [*range(1, 73), 96, 120, 240]:
        for primaries in (p for p in range(1, 17) if count % p == 0):
            even = Counter({i: count // primaries for i in range(primaries)})
            for ranges in (cli_slot_ranges(primaries), _floor_ranges(primaries)):
                if _shards_per_primary(count, ranges) != even:
                    uneven.append((count, primaries))
    assert not uneven, f"(K, primaries) whose shards do not spread evenly: {uneven[:20]}"


def test_a_request_s_shard_is_crc32_of_its_id_mod_k():
    layout = sharded(12)
    for request_id in ("chatcmpl-1", "msg_01ABC", "r-é", "x" * 200, ""):
        expected = zlib.crc32(request_id.encode("utf-8")) % 12
        assert layout.for_request(request_id) is layout.shards[expected]
        assert sharded(12).for_request(request_id) == layout.for_request(request_id)  # another process, the same answer
    # Pinned to CRC-32's published check value, crc32("123456789") = 0xCBF43926 (IEEE, unsigned),
    # which a producer in any language computes the same: 3421780262 mod 12 = 2.
    assert layout.for_request("123456789").index == 0xCBF43926 % 12 == 2


def test_request_ids_spread_over_every_shard():
    layout = sharded(6)
    counts = Counter(layout.for_request(f"chatcmpl-{i}").index for i in range(600))
    assert set(counts) == set(range(6)) and min(counts.values()) > 50, counts
