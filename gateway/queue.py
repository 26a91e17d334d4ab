"""The request streams: enqueue (with backpressure), withdraw, cancel.

A request goes to its model's stream for its priority (protocol/keys.py: interactive requests to
`lmq:req:<model>`, batch ones to `lmq:req-batch:<model>`); the backpressure counts that stream.
On a Redis Cluster each of the K shards has such streams and a request goes to the shard its id
hashes to; the backpressure then counts that shard's stream against 1/K of `max_queue`, so
admission stays one round trip. With API keys, each entry also takes a place in its key's share
of the queue (queue_share.py) until a worker picks it up or it is withdrawn.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

import protocol
from protocol.keys import INTERACTIVE, ShardLayout
from protocol.request_groups import RequestGroups

from .errors import ApiError
from .queue_share import QueueShare

log = logging.getLogger(__name__)


class RequestQueue:
    def __init__(
        self,
        redis: aioredis.Redis,
        shards: ShardLayout,
        max_queue: int,
        retry_after: int,
        share: QueueShare | None = None,
    ):
        self.redis = redis
        self.share = share
        self._claims: dict[str, str] = {}  # request id → its key's share, until picked up or withdrawn
        self.shards = shards
        self.max_queue = max_queue
        self._max_per_shard = -(-max_queue // len(shards.shards))
        self.retry_after = retry_after
        self.groups = RequestGroups(redis)

    def stream_of(self, request: protocol.Request) -> str:
        return self.shards.for_request(request.id).request_stream(request.model, request.priority)

    async def waiting(self, model: str, priority: str = INTERACTIVE) -> int:
        """Requests in the model's streams of `priority` (all shards) that no worker has taken yet."""
        return sum([await self._waiting_in(shard.request_stream(model, priority)) for shard in self.shards.shards])

    async def _waiting_in(self, stream: str) -> int:
        """Workers delete finished entries, so the stream holds waiting and running work; the
        group's pending list holds the running part."""
        await self.groups.ensure(stream)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xlen(stream)
        pipe.xpending(stream, protocol.REQUEST_GROUP)
        try:
            length, pending = await pipe.execute()
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):  # a cluster pipeline wraps the message
                raise
            self.groups.forget(stream)  # lost with Redis's data: create it again
            await self.groups.ensure(stream)
            return await self.redis.xlen(stream)
        return max(0, length - pending["pending"])

    async def submit(self, request: protocol.Request) -> str:
        """Append the request to its model's stream; returns the entry id. A full queue is a 429."""
        stream = self.stream_of(request)
        if await self._waiting_in(stream) >= self._max_per_shard:
            raise ApiError(
                429,
                f"the queue for {request.model} is full ({self.max_queue} requests waiting); retry later",
                code="overloaded",
                retry_after=self.retry_after,
            )
        claim = await self.share.claim(request.id) if self.share is not None else None
        try:
            entry_id = await self.redis.xadd(stream, {"msg": request.encode()})
        except BaseException:
            if self.share is not None:
                await self.share.release(claim, request.id)
            raise
        if claim is not None:
            self._claims[request.id] = claim
        return entry_id.decode()

    async def picked_up(self, request: protocol.Request) -> None:
        """A worker holds the request (or the gateway gave it up): its place in its key's share is free."""
        claim = self._claims.pop(request.id, None)
        if claim is not None and self.share is not None:
            await self.share.release(claim, request.id)

    async def taken(self, request: protocol.Request, entry_id: str) -> bool:
        """Whether a worker has read the request (it is pending in the group)."""
        try:
            return bool(
                await self.redis.xpending_range(
                    self.stream_of(request), protocol.REQUEST_GROUP, min=entry_id, max=entry_id, count=1
                )
            )
        except RedisError as exc:
            log.warning("could not tell whether %s was taken: %s", request.id, exc)
            return False

    async def withdraw(self, request: protocol.Request, entry_id: str, cancel_token: str) -> None:
        """Take back a request the client no longer waits for: unread, it is deleted; running, it is
        cancelled with the token whose digest the request carries (so no one else's request of that id
        is touched). Two commands, not a pipeline: a cluster pipeline refuses PUBLISH."""
        await self.picked_up(request)
        try:
            await self.redis.xdel(self.stream_of(request), entry_id)
            await self.redis.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message(request.id, cancel_token))
        except RedisError as exc:  # the worker still drops it at its deadline
            log.warning("could not withdraw %s: %s", request.id, exc)
