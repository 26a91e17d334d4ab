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
