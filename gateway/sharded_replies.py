"""The gateway's replies on a Redis Cluster: one sharded pub/sub channel per shard.

A plain PUBLISH on a cluster is carried to every node over the cluster bus, so every reply would
cost every primary something. Here each request names the channel of its own shard,
`lmq:{T[k]}:reply:<gateway id>` (kind `spubsub`), the worker's step script SPUBLISHes it within
the shard's slot, and only the primary that serves the slot carries it.

The router keeps one connection per primary, which SSUBSCRIBEs the channels of the shards that
primary serves (one SSUBSCRIBE per channel: Redis refuses one over several slots), and one reader
per connection. The promise is the plain router's: it listens before any request is accepted, and
when a subscription breaks (a connection error, a node that pushes `sunsubscribe` because the slot
moved) every open request is told, the subscriptions are rebuilt from a fresh slot map (`listening`
is false until they are), and then every open request asks its worker for what it missed
(gateway/resume.py), or ends with an `unavailable` error when no worker answers in time.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

import protocol
from protocol.keys import ShardLayout
from protocol.redis_client import REDIS_FAILURES

from .replies import RECONNECT_DELAY_S, ReplyRouter
from .resume import INTERRUPTED, RESUBSCRIBED

log = logging.getLogger(__name__)


class SubscriptionBroken(Exception):
    """A node's connection broke or dropped one of our channels."""


class ShardedReplyRouter(ReplyRouter):
    def __init__(self, redis: RedisCluster, shards: ShardLayout, gateway_id: str):
        super().__init__(redis, protocol.gateway_reply_channel(gateway_id))
        self.shards = shards
        self.channels = [shard.key(f"reply:{gateway_id}") for shard in shards.shards]
        self._node_pubsubs: list[aioredis.client.PubSub] = []

    def reply_for(self, request_id: str) -> protocol.Reply:
        return protocol.Reply("spubsub", self.channels[self.shards.for_request(request_id).index])

    async def start(self) -> None:
        await self.redis.initialize()
        await self._subscribe()  # a gateway that cannot listen does not start
        self.listening = True
        self._reader = asyncio.create_task(self._run(), name="replies:sharded")

    async def stop(self) -> None:
        if self._reader:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self._unsubscribe()

    async def _subscribe(self) -> None:
        """One pub/sub connection per primary, subscribed to the channels of its slots, confirmed."""
        by_node: dict[str, tuple] = {}
        for channel in self.channels:
            node = self.redis.get_node_from_key(channel)
            by_node.setdefault(node.name, (node, []))[1].append(channel)
        for node, channels in by_node.values():
            pool = aioredis.ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
            pubsub = aioredis.Redis(connection_pool=pool).pubsub()
            self._node_pubsubs.append(pubsub)
            for channel in channels:
                await pubsub.ssubscribe(channel)
            for _ in channels:
                await self._confirmed(pubsub)

    async def _confirmed(self, pubsub: aioredis.client.PubSub) -> None:
        while True:
            message = await pubsub.get_message(timeout=None)
            if message is not None and message["type"] == "ssubscribe":
                return
            if message is not None and message["type"] == "smessage":
                self._route(message["data"])

    async def _unsubscribe(self) -> None:
        pubsubs, self._node_pubsubs = self._node_pubsubs, []
        for pubsub in pubsubs:
            await asyncio.gather(pubsub.aclose(), pubsub.connection_pool.aclose(), return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self._read_until_broken()
            except (
                Exception
            ) as exc:  # whatever broke a subscription (redis-py's own errors included), the reader goes on
                log.warning("reply subscription lost (%r); subscribing again", exc)
            self.listening = False
            self._tell_open_requests(INTERRUPTED)
            await self._unsubscribe()
            await asyncio.sleep(RECONNECT_DELAY_S)
            try:
                await self.redis.nodes_manager.initialize()  # the slot map may have changed
                await self._subscribe()
                self.listening = True
                self._tell_open_requests(RESUBSCRIBED)
            except REDIS_FAILURES as exc:
                log.warning("could not subscribe to replies again (%s); retrying", exc)
                await self._unsubscribe()

    async def _read_until_broken(self) -> None:
        if not self._node_pubsubs:
            raise SubscriptionBroken("not subscribed")
        readers = [asyncio.create_task(self._read_node(pubsub)) for pubsub in self._node_pubsubs]
        try:
            done, _ = await asyncio.wait(readers, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def _read_node(self, pubsub: aioredis.client.PubSub) -> None:
        while True:
            message = await pubsub.get_message(timeout=None)
            if message is None:
                continue
            if message["type"] == "smessage":
                self._route(message["data"])
            elif message["type"] in (
                "sunsubscribe",
                "ssubscribe",
            ):  # a slot moved, or redis-py re-subscribed after a reconnect
                raise SubscriptionBroken(f"{message['type']} on {message['channel']!r}")
