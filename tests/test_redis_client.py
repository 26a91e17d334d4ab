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
