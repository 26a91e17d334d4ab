"""Background responses (`background: true`): run through the queue, driven by whichever gateway holds the lease.

The POST stores the response (`queued`, its protocol request with a durable reply stream of its
own: store.py) and enqueues it; every gateway runs a `background_runner`, and the one that holds
a response's lease (gateway/leased_drivers.py, as for batches) drives it: it reads the worker's
events from the reply stream, builds the stream events (builder.py) and appends them to the
response's event stream, which GET ?stream=true follows, and writes the response object as it
changes (`in_progress`, then the end), which GET polls.

Nothing lives only in a driver's memory. A gateway that dies stops renewing its leases; another
takes the response over when its lease expires, reads the reply stream from its start, and
rebuilds the same events (their ids are made from the response's, builder.py), skipping those
already written. A restarted gateway finds its own responses the same way. A reply stream that lost
entries with Redis's data (a failover's last writes) shows a hole; the driver then resumes as a live
relay does (gateway/resume.py's `StreamOrder`): it asks the worker on `lmq:resume` (with the
response's cancel token) for the events after its last one, takes events only in order until the
worker's `resumed`, and fails the response (503, tokens lost) only when none comes within
`resume_timeout` or the worker no longer keeps them. A stream that lost only its last entries
(its `done` among them) shows no hole, so a driver that takes a response over resumes the same
way, once, when it has read the stream to its end without an end. Redis unreachable (a restart,
a failover): the driver keeps the lease through the outage, up to `resume_timeout`, rather than
handing the response back to wait for the lease's expiry; once Redis answers it takes the lease
again if that expired and nobody took it, and drives the response again from what Redis holds,
as a driver that takes it over does (read from the start, asking once at the end). Enqueueing is one
script (once, whoever asks), so a response dropped between its record and its XADD is enqueued by
its next driver.

On a gateway with API keys a response's entry takes a place in its key's share of the queue, as a
live request's entries do (gateway/queue_share.py), from its XADD until a worker starts it. While
the share is full the response waits, `queued`, out of the queue, and its driver tries again each
tick: it is not refused, as a batch item waits for its key's budget rather than failing (what the
live path refuses, a full queue for the model, the POST still refuses).

Cancelling sets a flag (store.py); the driver withdraws the entry (deleted if no worker read it,
else cancelled with the token whose digest the request carries) and ends the response `cancelled`
with what it had written. A response that has not ended some time after its deadline (a Redis
that lost the entry) ends `failed`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import protocol
from protocol.redis_client import UNREACHABLE

from ..context import Gateway
from ..errors import ApiError
from ..generation import Done, Usage
from ..leased_drivers import LEASE_MS, Lease, LeasedDrivers
from ..reasoning import Thinking
from ..resume import DROP, LOST, StreamOrder, ask_for
from ..token_order import token_gap
from ..tool_calls import ToolPlan
from .builder import ResponseBuilder
from .conversation import output_messages
from .store import ResponseStore

log = logging.getLogger(__name__)

READ_BLOCK_MS = 500
READ_COUNT = 256  # reply stream entries a read takes: fewer, and the stream is read to its end
RECONNECT_S = 0.5  # while Redis is unreachable, how often the driver tries it again
LATE_S = 30.0  # past its deadline by this much, a response no worker answers ends failed
LOST_TOKENS = ApiError(503, "tokens of the answer were lost on the way from the worker")


def background_runner(gateway: Gateway, store: ResponseStore) -> LeasedDrivers:
    """This gateway's runner: a `Driver` for each background response it holds the lease of
    (gateway/leased_drivers.py)."""

    async def drive(lease: Lease) -> None:
        await Driver(gateway, store, lease).run()

    return LeasedDrivers(store, gateway.config.gateway_id, drive, "background response")


class Driver:
    """One background response, while this gateway holds its lease."""

    def __init__(self, gateway: Gateway, store: ResponseStore, lease: Lease):
        self.gateway = gateway
        self.limiter = gateway.limiter  # on a gateway with keys: a response's tokens count to its key
        self.store = store
        self.lease = lease
        self.id = lease.job_id
        self.cursor = "0-0"  # the last reply stream entry read
        self.tokens = 0  # completion tokens taken (the offsets of deltas, as generation.py checks them)
        self.written = 0  # events already in the event stream
        self.thinking = Thinking()  # splits a thinking model's deltas, as generation.py does for a live request
        self.owner = ""  # the digest of the key it belongs to
        self.started = False  # a worker started it: its place in its key's queue share is free
        self.order = StreamOrder(gateway.config.resume_timeout)  # which reply stream events to take
        self.unasked = False  # taken over: to resume once the reply stream is read to its end
        self.reconnected = False  # Redis answers again after an outage: the lease may need taking again

    async def run(self) -> None:
        while True:
            try:
                await self._drive()
                return
            except UNREACHABLE as exc:
                if not await self._ride_out(exc):
                    raise

    async def _ride_out(self, exc: Exception) -> bool:
        """Keep the lease through an outage, up to the resume bound: True once Redis answers again
        (the response is then driven again from what Redis holds, as a driver that takes it over
        would, and asks its worker for what the server lost), False past the bound (handed back)."""
        bound = self.gateway.config.resume_timeout
        log.warning("background response %s: redis unreachable (%s); keeping it for up to %g s", self.id, exc, bound)
        until = time.monotonic() + bound
        while time.monotonic() < until:
            await asyncio.sleep(RECONNECT_S)
            try:
                await self.store.redis.ping()
            except UNREACHABLE:
                continue
            self.reconnected = True
            log.warning("background response %s: redis answers again; reading its reply stream again", self.id)
            return True
        return False

    async def _held(self) -> bool:
        """The lease is still this gateway's; right after an outage it may have expired (or been lost
        with the server's last writes): taken again if nobody else took it."""
        if await self.lease.renew():
            return True
        return self.reconnected and await self.store.take_lease(self.id, self.lease.holder, LEASE_MS)

    async def _drive(self) -> None:
        """Drive the response from what Redis holds: its reply stream read from the start (events
        already written are not written again) until it ends or the lease is lost."""
        record = await self.store.record(self.id)
        if record is None or record.get("state") != "running":
            await self.store.forget(self.id)
            return
        self.owner = record.get("owner", "")
        self.cursor, self.tokens, self.thinking = "0-0", 0, Thinking()
        self.order = StreamOrder(self.gateway.config.resume_timeout)
        builder = rebuild(self.id, record)
        self.written = await self.store.written(self.id)
        # Driven before (by a gateway that stopped, or by this one before an outage): it wrote the start.
        # Its first driver asks nothing, or the worker would write again what it wrote, maybe after the end.
        self.unasked = "entry" in record and self.written > 0
        await self._emit(builder.start(queued=True))
        while await self._held():
            self.reconnected = False
            record = await self.store.record(self.id)
            if record is None:
                await self._withdraw(None)
                await self._free_place()
                return  # deleted
            if await self._tick(record, builder):
                return

    async def _tick(self, record: dict[str, str], builder: ResponseBuilder) -> bool:
        """One round; True once the response has ended."""
        if record.get("cancel"):
            await self._withdraw(record)
            builder.cancel()
            await self._end(record, builder)
            return True
        if "entry" not in record:
            await enqueue(self.gateway, self.store, self.id, record)
        elif not self.started and self.gateway.queue.share is not None:
            await self.gateway.queue.share.hold_owner(self.owner, self.id)  # it may wait past a pickup timeout
        if time.time() > float(record["deadline"]) + LATE_S:
            error = ApiError(504, "the response did not finish before its deadline")
            return await self._ended(record, builder, builder.fail(error))
        if self.order.due_ask():
            await ask_for(self.store.redis, self.id, self.order.last_seq, self.tokens, record.get("cancel_token"))
        if self.order.expired():
            return await self._ended(record, builder, builder.fail(LOST_TOKENS))
        reply = await self.store.redis.xread(
            {self.store.reply_stream(self.id): self.cursor}, count=READ_COUNT, block=READ_BLOCK_MS
        )
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self.cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                try:
                    event = protocol.decode_event(fields.get(b"msg", b""))
                except protocol.ProtocolError:
                    continue
                verdict = self.order.admit(event, self.tokens)
                if verdict == LOST:
                    return await self._ended(record, builder, builder.fail(LOST_TOKENS))
                if verdict == DROP:
                    continue
                events, ended = self._fold(builder, event)
                if ended:
                    return await self._ended(record, builder, events)
                await self._emit(events)
                if event.get("type") == "started":
                    await self.store.update(self.id, {"response": builder.response()})
                    self.started = True
                    await self._free_place()
        self._ask_taken_over(reply)
        return False

    def _ask_taken_over(self, reply: list | None) -> None:
        """Once a response taken over is read to its stream's end (a read short of its count), resume:
        the entries its worker wrote last (`done` among them) may be lost with Redis's data, and then
        no hole shows (a read that met the end ended the response before this)."""
        read = sum(len(entries) for _, entries in reply or [])
        if self.unasked and read < READ_COUNT:
            self.unasked = False
            if not self.order.resume.active:
                self.order.resume_now()

    def _fold(self, builder: ResponseBuilder, event: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
        """The stream events a worker event makes, and whether the response ended with it."""
        kind = event.get("type")
        if kind == "started":
            self.thinking.started(event)
            return builder.begin(), False
        if kind == "delta":
            token_ids, gap = list(event.get("token_ids") or []), token_gap(event, self.tokens)
            if gap < 0:
                return [], False  # a re-run after a worker death repeating tokens already taken
            if gap > 0:
                return builder.fail(LOST_TOKENS), True
            self.tokens += len(token_ids)
            logprobs = event.get("logprobs") if isinstance(event.get("logprobs"), list) else None
            piece = self.thinking.feed(str(event.get("text", "")), len(token_ids))
            return builder.feed(piece.content, piece.reasoning, logprobs), False
        if kind == "done":
            if event.get("finish_reason") == "cancelled":
                builder.cancel()
                return [], True
            usage = event.get("usage") or {}
            if token_gap(event, self.tokens) > 0:
                return builder.fail(LOST_TOKENS), True
            tail = self.thinking.finish()
            done = Done(
                finish_reason=str(event.get("finish_reason")),
                stop_sequence=event.get("stop_sequence"),
                usage=Usage(
                    int(usage.get("prompt_tokens", 0)),
                    int(usage.get("completion_tokens", 0)),
                    int(usage.get("cached_tokens", 0)),
                    reasoning_tokens=self.thinking.tokens,
                ),
            )
            return builder.feed(tail.content, tail.reasoning) + builder.finish(done), True
        if kind == "error":
            return builder.fail(ApiError.from_worker(str(event.get("code")), str(event.get("message")))), True
        return [], False

    async def _ended(self, record: dict[str, str], builder: ResponseBuilder, events: list[dict[str, Any]]) -> bool:
        await self._emit(events)
        await self._end(record, builder)
        return True

    async def _end(self, record: dict[str, str], builder: ResponseBuilder) -> None:
        history = json.loads(record.get("history") or "[]") + output_messages(builder.output)
        if self.limiter is not None and builder.usage is not None:
            # Before the end, once by the response's id: an end whose reply was lost leaves nothing to
            # charge after it (the next drive finds the response ended), and a driver that dies between
            # the two charges nothing twice when the next one ends it.
            owner, tokens = record.get("owner", ""), builder.usage["total_tokens"]
            await self.limiter.charge_owner_once(owner, f"response:{self.id}", tokens)
        await self.store.end(self.id, {"state": builder.status, "response": builder.response(), "history": history})
        await self._free_place()
        self._count(record["model"], builder)
        log.info("background response %s %s", self.id, builder.status)

    def _count(self, model: str, builder: ResponseBuilder) -> None:
        """The response in this gateway's request metrics, once, at its end (a driver that died
        counted nothing); untimed, since a driver that took it over did not see it start."""
        metrics = self.gateway.metrics.request(model, "responses", timed=False)
        usage = builder.usage
        if usage is None:
            metrics.ended("internal" if builder.status == "failed" else builder.status)  # cancelled
            return
        metrics.tokens(usage["output_tokens"])
        metrics.done(
            "length" if builder.status == "incomplete" else "stop", usage["input_tokens"], usage["output_tokens"]
        )

    async def _emit(self, events: list[dict[str, Any]]) -> None:
        fresh = [event for event in events if event["sequence_number"] >= self.written]
        if fresh:
            await self.store.append(self.id, fresh)
            self.written = fresh[-1]["sequence_number"] + 1

    async def _withdraw(self, record: dict[str, str] | None) -> None:
        await withdraw(self.store, self.id, record)

    async def _free_place(self) -> None:
        if self.gateway.queue.share is not None:
            await self.gateway.queue.share.release_owner(self.owner, self.id)


async def enqueue(gateway: Gateway, store: ResponseStore, response_id: str, record: dict[str, Any]) -> None:
    """Put a queued background response's request in the queue, once its key's share of the queue has
    a place for it; while the share is full it stays out, and its driver asks again next tick."""
    share = gateway.queue.share
    if share is not None and not await share.claim_owner(record.get("owner", ""), response_id):
        return
    await store.enqueue(response_id, store.home.request_stream(record["model"]))


async def withdraw(store: ResponseStore, response_id: str, record: dict[str, str] | None) -> None:
    """Take a background response's request back: deleted if no worker read it, else cancelled."""
    if record is None or "entry" not in record:
        return
    stream, _, entry_id = record["entry"].partition(" ")
    await store.redis.xdel(stream, entry_id)
    await store.redis.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message(response_id, record.get("cancel_token")))


def rebuild(response_id: str, record: dict[str, str]) -> ResponseBuilder:
    """The builder of a stored background response, as its POST made it."""
    plan = ToolPlan(**json.loads(record["plan"]))
    logprobs = json.loads(record.get("logprobs") or "null")
    return ResponseBuilder(response_id, json.loads(record["echo"]), plan, float(record["created_at"]), logprobs)
