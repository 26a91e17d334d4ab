"""The gateway's one pub/sub subscription: event batches from workers, routed by request id."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError, TimeoutError

import protocol
from protocol.redis_client import pubsub

from .resume import INTERRUPTED, RESUBSCRIBED, marker

log = logging.getLogger(__name__)

RECONNECT_DELAY_S = 0.5
# Workers keep each reply message within protocol.MAX_MESSAGE_BYTES; one from an older worker that put a
# whole step in one message (and one huge event beside everyone's) is still read up to this size, so a
# rolling upgrade does not fail the other streams of that step.
OLD_WORKER_BATCH_BYTES = 16 << 20


LOST = "unavailable"  # the error code an open request gets when its events may have been missed
# A request whose client stopped reading queues its events here until sse.py's write timeout cuts
# it; this bounds that queue whatever the timeout and the step rate (a delta is one step's text of
# one request: a few hundred bytes, a few KiB with logprobs). Past it the request is ended.
MAX_PENDING_EVENTS = 4096


class AlreadyOpen(Exception):
    """A request with this id is open on this gateway: its events cannot go to two queues."""


class ReplyRouter:
    """Subscribes once, before any request is accepted, so no event can be published unheard.

    Pub/sub keeps nothing for a subscriber that is away: when the connection breaks (a Redis
    restart, a failover, a network cut), events published until it is re-subscribed are gone. Each
    open request is told (an `INTERRUPTED` marker in its queue, then `RESUBSCRIBED` once subscribed
    again) and asks its worker to send again what it missed (gateway/resume.py); one that gets no
    answer in time ends with an `unavailable` error, never with a silent hole. A break shows as a
    ConnectionError, or, where redis-py reconnected by itself, as a second `subscribe` confirmation. `listening` is false from a ConnectionError until the next confirmation: /ready
    says 503 meanwhile, since a request taken then would fail when the subscription comes back.
    """

    def __init__(self, redis: aioredis.Redis, channel: str):
        self.redis = redis
        self.channel = channel
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._pubsub: aioredis.client.PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        self.listening = False

    async def start(self) -> None:
        self._pubsub = await pubsub(self.redis)
        await self._pubsub.subscribe(self.channel)
        self.listening = True
        self._reader = asyncio.create_task(self._read(), name=f"replies:{self.channel}")

    async def stop(self) -> None:
        if self._reader:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._pubsub:
            await self._pubsub.aclose()

    def reply_for(self, request_id: str) -> protocol.Reply:
        """Where workers send the events of request `request_id`."""
        return protocol.Reply("pubsub", self.channel)

    def open(self, request_id: str) -> asyncio.Queue[dict[str, Any]]:
        """The queue that will receive the request's events. An id already open raises AlreadyOpen:
        replacing its queue would hand the running request's events to the newcomer."""
        if request_id in self._queues:
            raise AlreadyOpen(request_id)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def is_open(self, request_id: str) -> bool:
        return request_id in self._queues

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _read(self) -> None:
        assert self._pubsub is not None
        subscribed = False
        while True:
            try:
                message = await self._pubsub.get_message(timeout=None)
            except (ConnectionError, TimeoutError) as exc:
                log.warning("reply subscription lost (%s); reconnecting", exc)
                self.listening = False
                self._tell_open_requests(INTERRUPTED)
                await asyncio.sleep(RECONNECT_DELAY_S)
                continue
            if message is None:
                continue
            if message["type"] == "subscribe":
                if subscribed:
                    log.warning(
                        "reply subscription re-established; %d open requests ask for what they missed",
                        len(self._queues),
                    )
                    self._tell_open_requests(RESUBSCRIBED)
                subscribed = self.listening = True
            elif message["type"] == "message":
                self._route(message["data"])

    def _tell_open_requests(self, kind: str) -> None:
        """Put a resume marker (gateway/resume.py) in every open request's queue."""
        for request_id, queue in self._queues.items():
            queue.put_nowait(marker(kind, request_id))

    def _route(self, data: bytes) -> None:
        if len(data) > protocol.MAX_MESSAGE_BYTES:  # a worker that predates the split of a step's message
            log.warning(
                "a reply on %s is %d bytes, over the %d that workers keep to; routed all the same",
                self.channel,
                len(data),
                protocol.MAX_MESSAGE_BYTES,
            )
        try:
            events = protocol.decode_event_batch(data, OLD_WORKER_BATCH_BYTES)
        except protocol.ProtocolError as exc:
            log.warning("dropped a malformed reply on %s: %s", self.channel, exc)
            return
        for event in events:
            queue = self._queues.get(event.get("id"))
            if queue is None:  # the client is gone; a late event has no one to go to
                continue
            if queue.qsize() >= MAX_PENDING_EVENTS:
                self._cut_slow_reader(event.get("id"), queue)
                continue
            queue.put_nowait(event)

    def _cut_slow_reader(self, request_id: str, queue: asyncio.Queue[dict[str, Any]]) -> None:
        """End a request whose reader left MAX_PENDING_EVENTS unread: its queue is emptied and
        closed with an error, so what one slow client costs the gateway stays bounded."""
        log.warning("request %s: its client left %d events unread; the request is ended", request_id, queue.qsize())
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(
            protocol.error_event(request_id, -1, LOST, "the client read its answer too slowly; the request was ended")
        )
        self.close(request_id)
