"""Many concurrent commands on one client wait for a connection instead of failing."""

import asyncio

from protocol.redis_client import MAX_CONNECTIONS, connect


async def test_more_concurrent_commands_than_connections_all_succeed(redis_url):
    client = connect(redis_url)
    try:
        lengths = await asyncio.gather(*(client.xlen("lmq:req:nothing") for _ in range(3 * MAX_CONNECTIONS)))
    finally:
        await client.aclose()
    assert lengths == [0] * (3 * MAX_CONNECTIONS)


async def test_after_a_redis_restart_no_command_fails_on_a_dead_pooled_connection(fresh_redis_server):
    server = fresh_redis_server(appendonly=True)
    client = connect(server.url)
    try:
        await asyncio.gather(*(client.xlen("lmq:req:x") for _ in range(20)))  # fills the pool with connections
        server.kill()
        server.start()
        for _ in range(40):  # each would pick up a dead connection first
            assert await client.xadd("lmq:req:x", {"msg": b"m"})
    finally:
        await client.aclose()


async def test_a_cluster_client_routes_stream_reads_by_their_slot_without_asking_the_server():
    """redis-py would ask a node for an XREAD's keys (COMMAND GETKEYS) before each read; the slot is
    worked out here, so no node is asked (this client has none to ask: its address is never dialled)."""
    from redis.crc import key_slot

    from protocol.redis_client import connect, stream_read_keys

    client = connect("redis+cluster://127.0.0.1:1/?shards=6")
    stream = "lmq:{0.1}:req:m"
    group_read = ("GROUP", "workers", "w1", "COUNT", 2, "STREAMS", stream, ">")
    assert await client._determine_slot("XREADGROUP", *group_read) == key_slot(stream.encode())
    assert await client._determine_slot("XREAD", "COUNT", 1, "BLOCK", 1000, "STREAMS", stream, "0-0") == key_slot(
        stream.encode()
    )
    assert stream_read_keys("XREADGROUP", ("GROUP", "STREAMS", "c", "STREAMS", "a", "b", ">", ">")) == ["a", "b"]
    assert stream_read_keys("XREAD", ("STREAMS", "a", "b", "0-0")) == [], "keys and ids must pair up"
    assert stream_read_keys("GET", ("STREAMS",)) == []
