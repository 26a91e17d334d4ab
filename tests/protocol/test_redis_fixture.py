"""The Redis servers the tests run on: the default one, one of each kind, and a server of a test's
own that is killed and restarted, with and without the append-only file."""

import pytest
import redis

from lmq.redis_server import EmbeddedRedis, find_redis_server, free_tcp_port

EXPECTED = {"redis6": ("redis", "6.2."), "valkey9": ("valkey", "9.")}


async def test_real_redis_answers(redis_client):
    await redis_client.set("k", "v")
    assert await redis_client.get("k") == b"v"
    info = await redis_client.info("server")
    assert tuple(map(int, info["redis_version"].split(".")[:2])) >= (6, 2)


async def test_each_kind_answers_with_its_version(redis_kind, any_redis_server, any_redis_url):
    name, prefix = EXPECTED[redis_kind]
    assert (any_redis_server.name, any_redis_server.version[: len(prefix)]) == (name, prefix)
    client = redis.asyncio.Redis.from_url(any_redis_url)
    try:
        await client.xadd("lmq:req:m", {"body": b"x"})
        assert await client.xlen("lmq:req:m") == 1
        info = await client.info("server")
        assert info.get("valkey_version", info["redis_version"]) == any_redis_server.version
    finally:
        await client.aclose()


def test_default_server_follows_lmq_redis_server(monkeypatch):
    monkeypatch.setenv("LMQ_REDIS_SERVER", find_redis_server("redis6"))
    assert find_redis_server() == find_redis_server("redis6")
    with pytest.raises(ValueError):
        find_redis_server("redis5")


@pytest.mark.parametrize("appendonly", [True, False], ids=["appendonly", "no-persistence"])
@pytest.mark.parametrize("kind", ["redis6", "valkey9"])
def test_restart_keeps_a_stream_only_with_appendonly(fresh_redis_server, kind, appendonly):
    server: EmbeddedRedis = fresh_redis_server(kind, appendonly=appendonly)
    url = server.url
    with redis.Redis.from_url(url) as client:
        client.xadd("lmq:req:m", {"body": b"x"})
        client.xgroup_create("lmq:req:m", "workers", id="0")

    server.kill()  # a crash: SIGKILL, right after the write was acknowledged
    server.start()
    assert server.url == url
    with redis.Redis.from_url(url) as client:
        assert client.xlen("lmq:req:m") == (1 if appendonly else 0)
        client.xadd("lmq:req:m", {"body": b"y"})

    server.restart()  # a clean shutdown and start
    with redis.Redis.from_url(url) as client:
        assert client.xlen("lmq:req:m") == (2 if appendonly else 0)
        if appendonly:
            assert [g["name"] for g in client.xinfo_groups("lmq:req:m")] == [b"workers"]


def test_a_fixed_port_survives_a_restart(fresh_redis_server):
    server = fresh_redis_server(port=free_tcp_port(), appendonly=True)
    with redis.Redis.from_url(server.url) as client:
        client.set("lmq:k", "v")
    server.kill()
    server.start()
    with redis.Redis.from_url(server.url) as client:
        assert client.get("lmq:k") == b"v"


def test_free_ports_lie_outside_the_range_outgoing_connections_take():
    """A chosen port stays free until its server binds it: the kernel gives a client's outgoing
    connection a source port from the ephemeral range, and one of those had taken a sentinel's port
    between its choice and its start ('Address already in use')."""
    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = {free_tcp_port() for _ in range(20)}
    assert all(not low <= port <= high for port in ports), sorted(ports)
    assert len(ports) > 1  # chosen at random, not one fixed port for every caller
