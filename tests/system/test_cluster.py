"""Redis Cluster: `REDIS_URL=redis+cluster://...?shards=K`, end to end through real processes.

One EmbeddedCluster (lmq/redis_cluster.py: three Valkey primaries, the slots split as
`redis-cli --cluster create` splits them, K = 6 request shards) for the module, and a
tests/support/cluster_stack.py process stack on it: an `lmq gateway` and two worker processes on the
tiny model with slowed steps (tests/support/worker_process.py). The cluster's own behaviour (a script
touches one slot, PUBLISH reaches a subscriber on any node) is what lmq's sharded layout rests on,
so it is shown first; then the official OpenAI SDK gets the exact greedy answers, each request
lands in the shard its id hashes to and the shards spread over every primary; a foreign producer
that follows docs/protocol.md's sharded form gets its replies on a channel and on a tagged
stream, and an untagged reply stream is refused and dead-lettered wherever its slot lies; a
worker SIGKILLed mid-stream is taken over.
The expected answers come from an undisturbed run of the engine in this process (float32
greedy: the same in any batch), as in tests/system/test_faults.py.
"""

from __future__ import annotations

import asyncio
import uuid

import msgpack
import openai
import pytest
import redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, ResponseError

import protocol
from lmq.redis_cluster import EmbeddedCluster
from protocol.keys import sharded
from tests.support.cluster_stack import cluster_stack
from tests.support.process_stack import (
    CLAIM_IDLE_MS,
    CLIENT_TIMEOUT_S,
    MAX_TOKENS,
    MODEL,
    ChatStream,
    PromptPool,
    Stack,
    StackSpec,
    assert_contiguous,
    assert_serves_exactly_again,
    chat_messages,
    delta_tokens,
    eventually,
    foreign_request,
    through_a_fault,
)

SHARDS = 6  # two per primary
CLAIM_S = CLAIM_IDLE_MS / 1000
TERMINAL = ("done", "error")

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with EmbeddedCluster(primaries=3, shards=SHARDS, root=tmp_path_factory.mktemp("cluster")) as started:
        yield started


@pytest.fixture(scope="module")
def stack(cluster: EmbeddedCluster, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir):
    spec, root = StackSpec("cluster", workers=2, gateways=1), tmp_path_factory.mktemp("cluster-stack")
    with cluster_stack(cluster, spec, root, tiny_model_dir) as built:
        yield built


@pytest.fixture
async def ready(stack: Stack) -> Stack:
    await stack.prepare()
    return stack


@pytest.fixture(scope="module")
async def pool(tiny) -> PromptPool:
    return await PromptPool.build(tiny, size=8, candidates=20)


# ---------------------------------------------------------------- the cluster itself


def test_the_cluster_splits_the_slots_and_each_primary_serves_two_shards(cluster):
    assert cluster.url == f"redis+cluster://{','.join(f'127.0.0.1:{port}' for port in cluster.ports)}/?shards={SHARDS}"
    with cluster.nodes[1].client(decode_responses=True) as client:
        slots = sorted(
            (int(first), int(last), int(owner[1]))
            for first, last, owner, *_ in client.execute_command("CLUSTER", "SLOTS")
        )
    assert slots == [(0, 5460, cluster.ports[0]), (5461, 10922, cluster.ports[1]), (10923, 16383, cluster.ports[2])]
    owners = [cluster.node_of(shard.request_stream(MODEL)) for shard in sharded(SHARDS).shards]
    assert owners == [0, 0, 1, 1, 2, 2]


async def test_a_script_on_one_shard_runs_and_its_publish_reaches_a_subscriber_on_any_node(cluster):
    """What the worker's step script relies on: one slot per call, and PUBLISH from a script on one
    primary reaches a gateway subscribed (through redis-py's ClusterPubSub) on whichever node."""
    layout = sharded(SHARDS)
    channel = f"lmq:test:reply:{uuid.uuid4().hex[:8]}"
    client = RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    await client.initialize()
    subscription = client.pubsub()
    try:
        await subscription.subscribe(channel)
        script = client.register_script(
            "redis.call('XADD', KEYS[1], '*', 'k', 'v'); return redis.call('PUBLISH', ARGV[1], KEYS[1])"
        )
        # A cluster delivers a PUBLISH over its bus links, which may still be coming up just after the
        # cluster reports ok: each shard publishes again, every second, until it is heard (10 s at most).
        heard: set[str] = set()
        deadline = asyncio.get_running_loop().time() + 10
        while len(heard) < SHARDS and asyncio.get_running_loop().time() < deadline:
            for shard in layout.shards:
                if shard.key("test:s") not in heard:
                    assert await script(keys=[shard.key("test:s"), shard.progress_key("x")], args=[channel]) >= 0
            while (message := await subscription.get_message(ignore_subscribe_messages=True, timeout=1.0)) is not None:
                heard.add(message["data"].decode())
        assert heard == {shard.key("test:s") for shard in layout.shards}
        with pytest.raises((RedisClusterException, ResponseError), match="slot"):
            await script(keys=[layout.shards[0].key("test:s"), layout.shards[3].key("test:s")], args=[channel])
    finally:
        await subscription.aclose()
        await client.aclose()
    for shard in layout.shards:
        assert shard.key("test:s") in cluster.keys_on(
            cluster.node_of(shard.key("test:s"))
        )  # deleted by the next prepare()


# ---------------------------------------------------------------- the OpenAI SDK through a gateway and two workers


async def test_openai_sdk_answers_arrive_whole_and_each_request_lands_in_its_shard(ready, cluster, pool):
    stack = ready
    expected = pool.take(8)
    prompts = list(expected)
    added_before = {stream: stack.entries_added(stream) for stream in stack.streams}
    client = openai.AsyncOpenAI(
        base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )
    options = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})

    async def whole(prompt: str) -> tuple[str, str, str, object]:
        answer = await client.chat.completions.create(messages=chat_messages(prompt), **options)
        return answer.id, answer.choices[0].message.content, answer.choices[0].finish_reason, answer.usage

    async def streamed(prompt: str) -> tuple[str, str, str, object]:
        stream = await client.chat.completions.create(
            messages=chat_messages(prompt), stream=True, stream_options={"include_usage": True}, **options
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        finish = next(
            chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason
        )
        assert len({chunk.id for chunk in chunks}) == 1
        return chunks[0].id, text, finish, chunks[-1].usage

    answers = await asyncio.gather(*(whole(prompt) if i % 2 else streamed(prompt) for i, prompt in enumerate(prompts)))
    await client.close()
    problems = []
    for prompt, (request_id, text, finish, usage) in zip(prompts, answers):
        if (
            text != expected[prompt].text
            or finish != "length"
            or usage is None
            or usage.completion_tokens != MAX_TOKENS
        ):
            problems.append(
                f"{request_id} {prompt!r}: text={text!r} finish={finish} usage={usage}\n  expected {expected[prompt].text!r}"
            )
    assert not problems, "\n".join(problems) + f"\n{stack.log_tails()}"

    # Each request went to the shard its id hashes to (the completion's id is the request's id).
    ids = [request_id for request_id, *_ in answers]
    assert len(set(ids)) == len(ids)
    wanted: dict[str, int] = {}
    for request_id in ids:
        stream = stack.layout.for_request(request_id).request_stream(MODEL)
        wanted[stream] = wanted.get(stream, 0) + 1
    added = {stream: stack.entries_added(stream) - added_before[stream] for stream in stack.streams}
    assert added == {stream: wanted.get(stream, 0) for stream in stack.streams}, f"ids {ids}"
    await eventually(lambda: stack.clean(), "every shard's stream empty, nothing pending", 10, stack)


async def test_the_gateway_listens_on_one_sharded_channel_per_shard_on_the_primary_serving_it(ready, cluster):
    """Replies are SPUBLISHed within each shard's slot (kind `spubsub`), not broadcast to every node:
    the gateway holds one sharded subscription per shard, each on the node that serves its slot."""
    stack = ready
    heard: dict[int, set[str]] = {}
    for index, node in enumerate(cluster.nodes):
        with node.client(decode_responses=True) as client:
            heard[index] = set(client.execute_command("PUBSUB", "SHARDCHANNELS", "lmq:*"))
            assert not [channel for channel in client.execute_command("PUBSUB", "CHANNELS", "lmq:reply:*")], (
                "a plain reply channel"
            )
    channels = {channel for node_channels in heard.values() for channel in node_channels}
    assert len(channels) == SHARDS * len(stack.gateways), heard
    for shard in stack.layout.shards:
        mine = [channel for channel in channels if channel.startswith(shard.key("reply:"))]
        assert len(mine) == len(stack.gateways), (shard, heard)
        assert all(channel in heard[cluster.node_of(channel)] for channel in mine), heard


async def test_the_request_path_is_spread_over_every_primary_with_no_untagged_key(ready, cluster):
    stack = ready
    layout = stack.layout
    # Ids chosen so that every shard gets two: the streams of all K shards, on all three primaries, fill.
    ids: list[str] = []
    for shard in layout.shards:
        ids += [
            request_id
            for request_id in (f"spread-{uuid.uuid4().hex}" for _ in range(1000))
            if layout.for_request(request_id) == shard
        ][:2]
    assert len(ids) == 2 * SHARDS
    keys = {request_id: layout.for_request(request_id).key(f"reply:test:{request_id}") for request_id in ids}
    added_before = {stream: stack.entries_added(stream) for stream in stack.streams}
    for request_id in ids:
        request = foreign_request(request_id, f"spread {request_id}", keys[request_id], max_tokens=16)
        stack.admin.xadd(layout.for_request(request_id).request_stream(MODEL), {"msg": msgpack.packb(request)})

    seen: dict[str, int] = {}  # every key any node held while the requests ran, with that node

    def all_done() -> bool:
        seen.update(cluster.all_keys())
        return all(_events_end(stack, key) for key in keys.values())

    await eventually(all_done, f"{len(ids)} replies on their tagged streams", 60, stack)
    for request_id, key in keys.items():
        events = [protocol.decode_map(fields[b"msg"]) for _, fields in stack.admin.xrange(key)]
        assert events[-1]["type"] == "done" and events[-1]["usage"]["completion_tokens"] == 16, (request_id, events[-1])

    assert {stream: stack.entries_added(stream) - added_before[stream] for stream in stack.streams} == dict.fromkeys(
        stack.streams, 2
    )
    streams_by_node: dict[int, set[str]] = {}
    for key, node in seen.items():
        assert cluster.node_of(key) == node, f"{key} on node {node}"
        if key.endswith(f":req:{MODEL}"):
            streams_by_node.setdefault(node, set()).add(key)
    assert streams_by_node == {
        node: {stream for stream in stack.streams if cluster.node_of(stream) == node} for node in range(3)
    }
    assert {cluster.node_of(stream) for stream in stack.streams} == {0, 1, 2}
    untagged = sorted(key for key in seen if key.startswith("lmq:") and not key.startswith("lmq:{"))
    assert not untagged, f"lmq keys outside every shard: {untagged}"
    # The per-request keys of the run (holder, progress) are those of the request's own shard.
    per_request = [key for key in seen if ":holder:" in key or ":progress:" in key]
    assert any(request_id in key for key in per_request for request_id in ids), (
        f"no holder or progress key seen: {sorted(seen)}"
    )
    for key in per_request:
        request_id = key.rpartition(":")[2]
        if request_id in keys:
            assert key in (
                layout.for_request(request_id).holder_key(request_id),
                layout.for_request(request_id).progress_key(request_id),
            ), key
    assert stack.heartbeating() and all(cluster.node_of(layout.home.worker_key(name)) == 0 for name in stack.workers)


# ---------------------------------------------------------------- a foreign producer, as docs/protocol.md tells it


async def test_a_foreign_producer_on_a_cluster_gets_pubsub_and_tagged_stream_replies(ready, cluster, pool):
    stack = ready
    expected = pool.take(2)
    (prompt_a, answer_a), (prompt_b, answer_b) = expected.items()
    layout = sharded(SHARDS)  # what a producer computes from the K it was told
    tag = uuid.uuid4().hex[:8]
    producer = RedisCluster(host="127.0.0.1", port=cluster.ports[2])  # any node will do
    await producer.initialize()
    subscription = producer.pubsub()
    try:
        pubsub_id, stream_id = f"foreign-ps-{tag}", f"foreign-st-{tag}"
        channel = f"myapp:reply:{pubsub_id}"  # a channel may have any name
        reply_key = layout.for_request(stream_id).key(f"reply:test:{stream_id}")  # a stream carries its shard's tag
        await subscription.subscribe(channel)
        for request_id, request in (
            (pubsub_id, foreign_request(pubsub_id, prompt_a, channel, reply_kind="pubsub")),
            (stream_id, foreign_request(stream_id, prompt_b, reply_key)),
        ):
            await producer.xadd(layout.for_request(request_id).request_stream(MODEL), {"msg": msgpack.packb(request)})

        heard: list[dict] = []
        read: list[dict] = []

        async def listen() -> None:
            while not any(event.get("type") in TERMINAL for event in heard):
                message = await subscription.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message:  # one message per worker step: {"v": 1, "events": [...]}
                    heard.extend(msgpack.unpackb(message["data"])["events"])

        async def read_stream() -> None:
            last = "0"
            while not any(event.get("type") in TERMINAL for event in read):
                for _, entries in await producer.xread({reply_key: last}, block=1000) or []:
                    for entry_id, fields in entries:
                        read.append(protocol.decode_map(fields[b"msg"]))
                        last = entry_id

        try:
            await asyncio.wait_for(asyncio.gather(listen(), read_stream()), CLIENT_TIMEOUT_S)
        except TimeoutError:
            pytest.fail(
                f"no end within {CLIENT_TIMEOUT_S} s: heard {heard[-2:]}, read {read[-2:]}, dead letters {stack.dead_letters()}\n{stack.log_tails()}"
            )
    finally:
        await subscription.aclose()
        await producer.aclose()

    context = stack.log_tails()
    for name, events, answer in (("pubsub", heard, answer_a), ("stream", read, answer_b)):
        assert_contiguous(events, name)
        assert delta_tokens(events) == answer.token_ids, f"{name}: {events}\n{context}"
        assert events[-1]["type"] == "done" and events[-1]["usage"]["completion_tokens"] == MAX_TOKENS, (
            f"{name}: {events[-1]}"
        )
    assert cluster.node_of(reply_key) == cluster.node_of(layout.for_request(stream_id).request_stream(MODEL))

    await eventually(lambda: stack.clean(), "every shard's stream empty, nothing pending", 10, stack)


@pytest.mark.parametrize(
    "where",
    [
        "another-primary",
        "same-primary",  # a script may write any key its node holds: the worker refuses it at admission
    ],
)
async def test_a_reply_stream_without_the_shard_s_tag_is_refused_and_dead_lettered_in_the_shard(ready, cluster, where):
    stack = ready
    layout = stack.layout
    request_id = f"denied-{uuid.uuid4().hex[:8]}"
    shard = layout.for_request(request_id)
    home_node = cluster.node_of(shard.request_stream(MODEL))
    candidates = (f"myapp:reply:{request_id}.{n}" for n in range(10_000))
    untagged = next(key for key in candidates if (cluster.node_of(key) == home_node) == (where == "same-primary"))
    denied = msgpack.packb(foreign_request(request_id, "a reply stream outside the shard", untagged, max_tokens=4))
    stack.admin.xadd(shard.request_stream(MODEL), {"msg": denied})

    def dead_letter():
        assert not _events_end(stack, untagged), (
            f"the worker wrote the whole answer to {untagged}, outside the shard's slot"
        )
        return next((letter for letter in stack.dead_letters() if letter.get(b"msg") == denied), None)

    try:
        letter = await eventually(dead_letter, f"{request_id} dead-lettered in its shard", 15)
    except AssertionError as exc:
        written = bool(stack.admin.exists(untagged))
        raise AssertionError(
            f"{exc}: dead letters {stack.dead_letters()}; {untagged} written: {written}\n{stack.log_tails()}"
        ) from None
    assert letter[b"code"] == b"reply_denied", letter
    assert letter in [fields for _, fields in stack.admin.xrange(shard.dead_letter_stream)]
    assert not stack.admin.exists(untagged)
    await eventually(lambda: stack.clean(), "every shard's stream empty, nothing pending", 10, stack)


# ---------------------------------------------------------------- a worker SIGKILLed mid-stream


async def test_worker_killed_mid_stream_the_other_takes_over_and_every_stream_ends_exactly(ready, pool):
    stack = ready
    expected = pool.take(6)
    by_request: dict[str, str] = {}
    victim = survivor = ""

    async def the_busiest_worker_dies(_) -> None:
        nonlocal victim, survivor
        by_request.update(stack.holder_by_request())
        held = {name: sum(1 for holder in by_request.values() if holder == name) for name in stack.workers}
        victim = max(stack.workers, key=held.get)
        survivor = next(name for name in stack.workers if name != victim)
        assert held[victim], f"no worker holds an entry: {by_request}"
        stack.kill_worker(victim)

    streams = await through_a_fault(stack, expected, the_busiest_worker_dies, chunks=3)

    taken_over = [stream.request_id for stream in streams if by_request.get(stream.request_id) == victim]
    shards = sorted({stack.layout.for_request(request_id).index for request_id in taken_over})
    context = f"killed {victim} holding {taken_over} (shards {shards})\n{stack.log_tails()}"
    print(f"taken over from {victim}: {len(taken_over)} streams in shards {shards}")
    for stream in streams:
        stream.assert_exact(expected[stream.prompt].text, context)
    await stack.wait_drained(5 * CLAIM_S + 10)
    stack.assert_alive([survivor, *stack.gateways])


def _events_end(stack: Stack, key: str) -> bool:
    try:
        return any(protocol.decode_map(fields[b"msg"]).get("type") in TERMINAL for _, fields in stack.admin.xrange(key))
    except redis.RedisError:
        return False


# ---------------------------------------------------------------- a primary SIGKILLed mid-stream


async def test_primary_killed_mid_stream_every_stream_resumes_exactly_and_the_cluster_serves_again(
    tmp_path, tiny_model_dir, pool
):
    """A primary without a replica dies while four streams run, and comes back (empty: no
    persistence) a few seconds later. The cluster refuses every command meanwhile (its slots are
    down); what a client sees must be what a Redis restart gives it: its exact text (the gateway's
    sharded subscriptions broke, and each request's worker sends again what they missed), never a
    hang. Then fresh requests get exact answers and nothing is left pending."""
    with (
        EmbeddedCluster(primaries=3, shards=SHARDS, root=tmp_path / "cluster", node_timeout_ms=1000) as cluster,
        cluster_stack(
            cluster, StackSpec("cluster-fault", workers=1, gateways=1), tmp_path / "stack", tiny_model_dir
        ) as stack,
    ):
        await stack.prepare()
        expected, victim = pool.take(4), -1

        async def a_primary_dies_and_comes_back(streams: list[ChatStream]) -> None:
            nonlocal victim
            victim = cluster.node_of(stack.layout.for_request(streams[0].request_id).request_stream(MODEL))
            cluster.kill(victim)
            await asyncio.sleep(3)  # the other primaries mark it failed: the whole cluster refuses
            cluster.revive(victim)

        streams = await through_a_fault(stack, expected, a_primary_dies_and_comes_back, chunks=3)
        context = f"killed primary {victim}\n{stack.log_tails()}"
        for stream in streams:
            stream.assert_exact(expected[stream.prompt].text, context)
        await assert_serves_exactly_again(stack, pool, "after the revival")
        await stack.wait_drained(5 * CLAIM_S + 10)
        stack.assert_alive()


# ---------------------------------------------------------------- admission: a worker takes no more than its room

ADMIT_TOKENS = 64  # at least 64 slowed steps (worker_process.py sleeps each): no request ends for ~4 s
OBSERVE_S = 1.5  # how long a test watches the first requests run, well inside those ~4 s


def ids_one_per_shard(stack: Stack, prefix: str) -> list[str]:
    """A request id for each shard, in shard order (crc32 of the id picks the shard)."""
    ids: dict[int, str] = {}
    n = 0
    while len(ids) < SHARDS:
        candidate = f"{prefix}-{n}"
        ids.setdefault(stack.layout.for_request(candidate).index, candidate)
        n += 1
    return [ids[index] for index in range(SHARDS)]


def enqueue_one_per_shard(stack: Stack, prefix: str, prompts: list[str]) -> list[str]:
    """A foreign request in every shard's stream at once (pub/sub replies that nobody reads)."""
    ids = ids_one_per_shard(stack, f"{prefix}-{uuid.uuid4().hex[:6]}")
    with stack.admin.pipeline(transaction=False) as pipe:
        for index, (request_id, prompt) in enumerate(zip(ids, prompts)):
            request = foreign_request(
                request_id, prompt, "myapp:admitted", reply_kind="pubsub", max_tokens=ADMIT_TOKENS
            )
            pipe.xadd(stack.layout.shards[index].request_stream(MODEL), {"msg": msgpack.packb(request)})
        pipe.execute()
    return ids


def held(stack: Stack) -> dict[str, int]:
    """Worker -> entries pending for it, over every shard."""
    counts: dict[str, int] = {}
    for entry in stack.pending():
        counts[entry["consumer"].decode()] = counts.get(entry["consumer"].decode(), 0) + 1
    return counts


async def watch_holdings(stack: Stack, until_held: int) -> dict[str, int]:
    """Each worker's largest holding, seen from when `until_held` entries are held in all until OBSERVE_S
    later: a span in which no request can end (ADMIT_TOKENS slowed steps each), so a holding above a
    worker's slots is an overshoot, never an entry finished but not yet acknowledged."""
    await eventually(lambda: sum(held(stack).values()) >= until_held, f"{until_held} entries taken", 30, stack)
    most: dict[str, int] = {}
    deadline = asyncio.get_running_loop().time() + OBSERVE_S
    while asyncio.get_running_loop().time() < deadline:
        for worker, count in held(stack).items():
            most[worker] = max(most.get(worker, 0), count)
        await asyncio.sleep(0.05)
    return most


async def test_a_worker_reading_every_shard_takes_no_more_than_its_free_slots(ready, pool):
    """Six requests, one in each shard's stream, for an idle worker of two slots: its six readers wake
    at once, and together they take two; the other four wait in their streams and run as slots free up.
    (Each reader once took up to the free slots: the worker took all six.)"""
    stack = ready
    for name in list(stack.workers):
        stack.kill_worker(name)  # the next test's prepare() starts the usual two again
    worker = stack.start_worker(LMQ_MAX_SEQS="2")
    await eventually(lambda: stack.heartbeating([worker]), "the two-slot worker's heartbeat", 60, stack)
    enqueue_one_per_shard(stack, "two-slots", list(pool.take(SHARDS)))
    most = await watch_holdings(stack, until_held=2)
    assert most == {worker: 2}, f"a two-slot worker held {most}\n{stack.log_tails()}"
    await eventually(lambda: stack.clean(), "all six answered, every shard's stream empty", 90, stack)


async def test_six_requests_over_two_four_slot_workers_none_holds_more_than_four(ready, pool):
    """The load-balancing promise on a cluster: with 2 workers of 4 slots, 6 requests in 6 shards are
    split so that neither holds more than its 4 (one took 5 of 6 while the other idled)."""
    stack = ready
    for name in list(stack.workers):
        stack.kill_worker(name)
    workers = [stack.start_worker(LMQ_MAX_SEQS="4") for _ in range(2)]
    await eventually(lambda: stack.heartbeating(workers), "both workers' heartbeats", 60, stack)
    enqueue_one_per_shard(stack, "four-slots", list(pool.take(SHARDS)))
    most = await watch_holdings(stack, until_held=SHARDS)
    assert set(most) == set(workers) and max(most.values()) <= 4, f"holdings {most}\n{stack.log_tails()}"
    await eventually(lambda: stack.clean(), "all six answered, every shard's stream empty", 90, stack)


async def test_a_backlog_in_one_worker_s_shard_is_shared_with_a_worker_whose_own_shards_are_empty(ready, pool):
    """Shard affinity (worker/affinity.py) keeps the pull model's promise: four requests in shard 0,
    which the first of two workers prefers, and both workers have two slots: the second, whose own
    shards hold nothing, takes two of them, so neither idles while the other has a backlog."""
    stack = ready
    for name in list(stack.workers):
        stack.kill_worker(name)
    workers = [stack.start_worker(LMQ_MAX_SEQS="2") for _ in range(2)]
    await eventually(lambda: stack.heartbeating(workers), "both workers' heartbeats", 60, stack)
    halves = ("prefers shards [0, 2, 4] of 6", "prefers shards [1, 3, 5] of 6")
    await eventually(
        lambda: (
            sorted(half for half in halves for name in workers if half in stack.processes.log_text(name))
            == sorted(halves)
        ),
        "each worker preferring its half of the shards",
        30,
        stack,
    )
    stream = stack.layout.shards[0].request_stream(MODEL)
    with stack.admin.pipeline(transaction=False) as pipe:
        for i, prompt in enumerate(pool.take(4)):
            request = foreign_request(
                f"backlog-{uuid.uuid4().hex[:6]}-{i}",
                prompt,
                "myapp:admitted",
                reply_kind="pubsub",
                max_tokens=ADMIT_TOKENS,
            )
            pipe.xadd(stream, {"msg": msgpack.packb(request)})
        pipe.execute()
    most = await watch_holdings(stack, until_held=4)
    assert most == dict.fromkeys(workers, 2), f"holdings {most}\n{stack.log_tails()}"
    await eventually(lambda: stack.clean(), "all four answered, the stream empty", 90, stack)
