"""The gateway's one pub/sub subscription: event batches from workers, routed by request id."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError, TimeoutError

import protocol

log = logging.getLogger(__name__)

RECONNECT_DELAY_S = 0.5


class ReplyRouter:
    """Subscribes once, before any request is accepted, so no event can be published unheard."""

    def __init__(self, redis: aioredis.Redis, channel: str):
        self.redis = redis
        self.channel = channel
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._pubsub: aioredis.client.PubSub | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await self._pubsub.subscribe(self.channel)
        self._reader = asyncio.create_task(self._read(), name=f"replies:{self.channel}")

    async def stop(self) -> None:
        if self._reader:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._pubsub:
            await self._pubsub.aclose()

    def open(self, request_id: str) -> asyncio.Queue[dict[str, Any]]:
        """The queue that will receive the request's events."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _read(self) -> None:
        assert self._pubsub is not None
        while True:
            try:
                message = await self._pubsub.get_message(timeout=None)
            except (ConnectionError, TimeoutError) as exc:
                log.warning("reply subscription lost (%s); reconnecting", exc)
                await asyncio.sleep(RECONNECT_DELAY_S)
                continue
            if message is not None and message["type"] == "message":
                self._route(message["data"])

    def _route(self, data: bytes) -> None:
        try:
            events = protocol.decode_event_batch(data)
        except protocol.ProtocolError as exc:
            log.warning("dropped a malformed reply on %s: %s", self.channel, exc)
            return
        for event in events:
            queue = self._queues.get(event.get("id"))
            if queue is not None:  # else the client is gone; a late event has no one to go to
                queue.put_nowait(event)
