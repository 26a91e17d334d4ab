"""The workers' consumer group on a request stream, created by whichever process needs it first.

Gateways create it before their first XADD (so an entry is never added to a stream without the
group workers read it through), workers when they start reading; a Redis that lost its data has
lost the group too, so whoever meets `NOGROUP` forgets the stream and creates it again.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol.keys import REQUEST_GROUP


async def create_request_group(redis: aioredis.Redis, stream: str) -> None:
    """Create the group (and the stream); one that exists already is left as it is."""
    try:
        await redis.xgroup_create(stream, REQUEST_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class RequestGroups:
    """The streams this process has created the group on, so it asks Redis once per stream."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._created: set[str] = set()

    async def ensure(self, stream: str) -> None:
        if stream not in self._created:
            await create_request_group(self.redis, stream)
            self._created.add(stream)

    def forget(self, stream: str) -> None:
        """Redis lost the group (NOGROUP): the next `ensure` creates it again."""
        self._created.discard(stream)
