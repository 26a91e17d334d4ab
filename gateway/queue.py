"""The request streams: enqueue (with backpressure), withdraw, cancel.

A request goes to its model's stream for its priority (protocol/keys.py: interactive requests to
`lmq:req:<model>`, batch ones to `lmq:req-batch:<model>`); the backpressure counts that stream.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

import protocol
from protocol.request_groups import RequestGroups

from .errors import ApiError

log = logging.getLogger(__name__)


class RequestQueue:
    def __init__(self, redis: aioredis.Redis, max_queue: int, retry_after: int):
        self.redis = redis
        self.max_queue = max_queue
        self.retry_after = retry_after
        self.groups = RequestGroups(redis)

    async def waiting(self, model: str, priority: str = "interactive") -> int:
        """Requests in the model's stream of `priority` that no worker has taken yet.

        Workers delete finished entries, so the stream holds waiting and running work; the
        group's pending list holds the running part.
        """
        stream = protocol.request_stream(model, priority)
        await self.groups.ensure(stream)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xlen(stream)
        pipe.xpending(stream, protocol.REQUEST_GROUP)
        try:
            length, pending = await pipe.execute()
        except ResponseError as exc:
            if not str(exc).startswith("NOGROUP"):
                raise
            self.groups.forget(stream)  # lost with Redis's data: create it again
            await self.groups.ensure(stream)
            return await self.redis.xlen(stream)
        return max(0, length - pending["pending"])

    async def submit(self, request: protocol.Request) -> str:
        """Append the request to its model's stream; returns the entry id. A full queue is a 429."""
        if await self.waiting(request.model, request.priority) >= self.max_queue:
            raise ApiError(
                429,
                f"the queue for {request.model} is full ({self.max_queue} requests waiting); retry later",
                code="overloaded",
                retry_after=self.retry_after,
            )
        entry_id = await self.redis.xadd(protocol.request_stream(request.model, request.priority), {"msg": request.encode()})
        return entry_id.decode()

    async def taken(self, request: protocol.Request, entry_id: str) -> bool:
        """Whether a worker has read the request (it is pending in the group)."""
        stream = protocol.request_stream(request.model, request.priority)
        try:
            return bool(await self.redis.xpending_range(stream, protocol.REQUEST_GROUP, min=entry_id, max=entry_id, count=1))
        except RedisError as exc:
            log.warning("could not tell whether %s was taken: %s", request.id, exc)
            return False

    async def withdraw(self, request: protocol.Request, entry_id: str) -> None:
        """Take back a request the client no longer waits for: unread, it is deleted; running, it is cancelled."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xdel(protocol.request_stream(request.model, request.priority), entry_id)
        pipe.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message(request.id))
        try:
            await pipe.execute()
        except RedisError as exc:  # the worker still drops it at its deadline
            log.warning("could not withdraw %s: %s", request.id, exc)
