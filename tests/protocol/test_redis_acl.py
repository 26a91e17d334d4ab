"""The ACL user of docs/deploy.md (created from the doc's own line, tests/support/redis_acl.py) can run
everything lmq does on `lmq:` keys and channels, on every kind of server, and nothing outside. It has no
MULTI/EXEC: every write of lmq's that must land whole is one Lua script (process stacks run as this user,
so a code path that still sent MULTI would fail their tests)."""

import shlex

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from protocol.redis_client import connect
from tests.support.redis_acl import create_lmq_user, user_url

STREAM, GROUP = "lmq:req:m", "workers"
OUTSIDE = "myapp:reply:1"


@pytest.fixture
async def lmq_user(any_redis_url):
    client = connect(create_lmq_user(any_redis_url))  # the client gateways and workers use
    yield client
    await client.aclose()


async def test_the_queue_commands(lmq_user):
    r = lmq_user
    await r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    entry = await r.xadd(STREAM, {"msg": b"request"})
    assert await r.xlen(STREAM) == 1
    [[_, [(read_id, _)]]] = await r.xreadgroup(GROUP, "w1", {STREAM: ">"}, count=1)
    assert read_id == entry
    assert (await r.xpending(STREAM, GROUP))["pending"] == 1
    assert len(await r.xpending_range(STREAM, GROUP, "-", "+", 10)) == 1
    _, claimed, *_ = await r.xautoclaim(STREAM, GROUP, "w2", min_idle_time=0, start_id="0-0")
    assert [entry_id for entry_id, _ in claimed] == [entry]
    assert await r.xclaim(STREAM, GROUP, "w2", 0, [entry], justid=True) == [entry]
    assert await r.xack(STREAM, GROUP, entry) == 1
    assert await r.xdel(STREAM, entry) == 1


async def test_a_pipeline_heartbeats_and_scans(lmq_user):
    r = lmq_user
    async with r.pipeline(transaction=False) as pipe:
        pipe.publish("lmq:reply:g1", b"events")
        pipe.rpush("lmq:progress:1", 1, 2, 3)
        pipe.expire("lmq:progress:1", 3600)
        pipe.xadd("lmq:reply:s1", {"msg": b"event"}, maxlen=10000, approximate=True)
        pipe.expire("lmq:reply:s1", 3600)
        pipe.set("lmq:worker:w1", b"heartbeat", ex=10)
        await pipe.execute()
    assert await r.lrange("lmq:progress:1", 0, -1) == [b"1", b"2", b"3"]
    assert [key async for key in r.scan_iter(match="lmq:worker:*")] == [b"lmq:worker:w1"]
    assert await r.mget("lmq:worker:w1", "lmq:worker:w2") == [b"heartbeat", None]
    assert await r.exists("lmq:reply:s1") == 1
    assert await r.delete("lmq:progress:1", "lmq:reply:s1") == 2


async def test_pubsub_on_lmq_channels(lmq_user):
    pubsub = lmq_user.pubsub()
    await pubsub.subscribe("lmq:reply:g1", "lmq:cancel")
    assert await lmq_user.publish("lmq:reply:g1", b"events") == 1
    kinds = []
    while (message := await pubsub.get_message(timeout=2)) and message["type"] != "message":
        kinds.append(message["type"])
    assert kinds == ["subscribe", "subscribe"]
    assert (message["channel"], message["data"]) == (b"lmq:reply:g1", b"events")
    await pubsub.aclose()


async def test_lua_scripts(lmq_user):
    r = lmq_user
    assert await r.eval("return redis.call('INCR', KEYS[1])", 1, "lmq:counter") == 1
    sha = await r.script_load("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    assert await r.evalsha(sha, 1, "lmq:counter", 5) == 6
    # A Script object in a pipeline: redis-py runs SCRIPT EXISTS, then SCRIPT LOAD, then EVALSHA.
    script = r.register_script("redis.call('PUBLISH', KEYS[1], ARGV[1]); return redis.call('DECR', KEYS[2])")
    async with r.pipeline(transaction=False) as pipe:
        await script(keys=["lmq:reply:g1", "lmq:counter"], args=[b"x"], client=pipe)
        assert await pipe.execute() == [5]


async def test_nothing_outside_lmq(lmq_user):
    r = lmq_user
    for refused in (
        r.set(OUTSIDE, b"x"),
        r.xadd(OUTSIDE, {"msg": b"x"}),
        r.rpush(OUTSIDE, b"x"),
        r.publish(OUTSIDE, b"x"),
        r.eval("return redis.call('SET', KEYS[1], 'x')", 1, OUTSIDE),
        r.keys("lmq:*"),
        r.flushall(),
        r.config_get("maxmemory"),
        r.script_flush(),
    ):
        with pytest.raises(NoPermissionError):
            await refused
    # A key the script did not declare: refused inside the script (a plain script error).
    with pytest.raises(ResponseError, match="(?i)permission|can't access"):
        await r.eval("return redis.call('SET', 'myapp:reply:1', 'x')", 0)
    pubsub = r.pubsub()
    await pubsub.subscribe(OUTSIDE)
    with pytest.raises(NoPermissionError):
        await pubsub.get_message(timeout=2)
    await pubsub.aclose()


async def test_the_user_has_no_transactions(lmq_user):
    """lmq sends no MULTI (its multi-key writes are scripts, which a cluster runs on one slot), so the
    documented user is not granted one."""
    with pytest.raises(NoPermissionError):
        await lmq_user.execute_command("MULTI")
    with pytest.raises(NoPermissionError):
        await lmq_user.execute_command("WATCH", "lmq:counter")
    with pytest.raises(ResponseError, match="NOPERM"):
        await lmq_user.execute_command("EXEC")


async def test_running_the_line_again_resets_the_user(any_redis_url):
    first = create_lmq_user(any_redis_url, password="first-password")
    second = create_lmq_user(any_redis_url, password="second-password")
    assert second != first
    with redis.Redis.from_url(second) as client:
        assert client.ping()
    with pytest.raises(AuthenticationError), redis.Redis.from_url(first) as client:
        client.ping()
    with (
        pytest.raises(AuthenticationError),
        redis.Redis.from_url(user_url(any_redis_url, "lmq", "A_LONG_PASSWORD")) as client,
    ):
        client.ping()


def _producer_line() -> str:
    from tests.support.redis_acl import DEPLOY_DOC

    [line] = [
        line.strip() for line in DEPLOY_DOC.read_text().splitlines() if line.strip().startswith("ACL SETUSER myapp ")
    ]
    return line.replace("ITS_PASSWORD", "producer-password")


async def test_a_producers_user_of_the_doc_writes_requests_and_reads_only_its_replies(any_redis_url, any_redis_server):
    """docs/deploy.md's producer user (Redis 7+ / Valkey: a selector): XADD to request streams but not read
    them, read and delete its own reply keys, subscribe to its channels, announce cancels; nothing else."""
    if "valkey" not in any_redis_server.name.lower() and any_redis_server.version.startswith("6."):
        pytest.skip("ACL selectors need Redis 7 or Valkey")
    with redis.Redis.from_url(any_redis_url) as admin:
        admin.execute_command(*shlex.split(_producer_line()))
        admin.xadd("lmq:reply:myapp:1", {"msg": b"event"})
    r = connect(user_url(any_redis_url, "myapp", "producer-password"))
    try:
        await r.xadd(STREAM, {"msg": b"request"})
        assert len(await r.xrange("lmq:reply:myapp:1")) == 1
        await r.delete("lmq:reply:myapp:1")
        await r.publish("lmq:cancel", b"x")
        denied = {
            "read a request stream": lambda: r.xrange(STREAM),
            "write the dead letters": lambda: r.xadd("lmq:dead", {"msg": b"x"}),
            "write another's reply": lambda: r.xadd("lmq:reply:other:1", {"msg": b"x"}),
            "delete a request stream": lambda: r.delete(STREAM),
            "publish to a gateway": lambda: r.publish("lmq:reply:g1", b"x"),
        }
        for what, command in denied.items():
            with pytest.raises(NoPermissionError):
                await command()
                pytest.fail(f"the producer may {what}")
    finally:
        await r.aclose()


async def test_a_keys_queue_share(any_redis_url):
    """The gateway's per-key queue share (gateway/queue_share.py) runs under the documented user."""
    from gateway.queue_share import CLAIM_LUA, HOLD_LUA

    r = connect(create_lmq_user(any_redis_url))
    try:
        claim, hold = r.register_script(CLAIM_LUA), r.register_script(HOLD_LUA)
        assert await claim(keys=["lmq:ratelimit:{d}:queued"], args=["req-1", 1000, 60_000, 4]) == 0
        await hold(keys=["lmq:ratelimit:{d}:queued"], args=["req-1", 2000, 60_000])
        assert await r.zscore("lmq:ratelimit:{d}:queued", "req-1") == 62_000
        assert await r.zrem("lmq:ratelimit:{d}:queued", "req-1") == 1
        await hold(keys=["lmq:ratelimit:{d}:queued"], args=["req-1", 3000, 60_000])
        assert await r.zscore("lmq:ratelimit:{d}:queued", "req-1") is None  # a released claim is not taken again
    finally:
        await r.aclose()
