"""One request in flight: enqueued on entry, its events read as they come, withdrawn on an early exit.

    async with Generation(gateway, request) as generation:
        await generation.admitted(wait=10.0)  # optional: a worker's refusal raises here, before any reply
        async for event in generation.events(keepalive=5.0):
            ...  # Delta, then one Done; None when `keepalive` seconds passed without an event

A worker's `error` event, a request no worker started within `pickup_timeout`, and one past its
deadline all raise ApiError. Leaving the block before the `done` (the client went away, or an
error) withdraws the request: deleted from the stream if no worker read it yet, else cancelled.

A thinking model's answer comes split (gateway/reasoning.py): `Delta.text` is the answer's text and
`Delta.reasoning` the thinking's, as they stream; `Done.reasoning` is the whole thinking and
`Done.usage.reasoning_tokens` its tokens. For a model that does not think, reasoning is "" and 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from opentelemetry.trace import Status, StatusCode

import protocol
from protocol.tracing import traceparent, tracer

from . import access_log, rate_limits
from .context import Gateway
from .errors import ApiError
from .reasoning import Split, Thinking
from .replies import LOST, AlreadyOpen
from .resume import GAVE_UP, INTERRUPTED, RESUBSCRIBED, Resumption
from .resume import ask as ask_for_resume
from .token_order import token_gap


@dataclass(frozen=True)
class Delta:
    text: str  # the answer's text (a thinking model's thinking is in `reasoning`)
    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None = None  # per token, when the request asked (protocol `delta`)
    reasoning: str = ""  # the thinking's text in this delta


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int = 0  # of completion_tokens, those of the thinking


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" or "length" ("tokenized"/"detokenized" for those tasks)
    stop_sequence: str | None
    usage: Usage
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # a task's answer: prompt_ids, pieces, text
    reasoning: str = ""  # the whole thinking of a thinking model's answer


def new_request_id(prefix: str) -> str:
    """The client's X-Request-Id when it sent a usable one, else `prefix<24 hex>` (see access_log.py)."""
    return access_log.request_id(prefix)


def new_request(
    gateway: Gateway, request_id: str, model: str, sampling: protocol.SamplingParams, **prompt: Any
) -> protocol.Request:
    """A protocol request whose events come back to this gateway; `prompt` is messages=, prompt= or prompt_ids=.

    A client-chosen `request_id` becomes its owner's protocol id (access_log.owned_id). It is checked
    as a worker will check it, so a request the protocol refuses fails here (400 or 413), before it
    is enqueued. A reused id is refused (409) when it is opened: its choices may add suffixes.
    """
    owned = access_log.owned_id(request_id)
    request = protocol.Request(
        id=owned,
        model=model,
        reply=gateway.replies.reply_for(owned),
        sampling=sampling,
        deadline=time.time() + gateway.config.request_timeout,
        announce=True,
        **prompt,
    )
    try:
        checked = protocol.decode_request(request.encode())
    except protocol.ProtocolError as exc:
        raise ApiError(413 if exc.code == "too_large" else 400, exc.message, code=exc.code) from None
    return checked


def duplicate() -> ApiError:
    """A client reusing its X-Request-Id (or one its choices' ids `<id>-<index>` meet) while that request runs."""
    return ApiError(409, "a request with this X-Request-Id is already in progress", code="duplicate_id")


class Generation:
    """`api` names the endpoint in lmq_requests_total; `timed=False` keeps it out of the latency histograms."""

    def __init__(self, gateway: Gateway, request: protocol.Request, api: str = "", timed: bool = True):
        self.gateway = gateway
        self.request = request
        self.metrics = gateway.metrics.request(request.model, api, timed)
        access_log.note(model=request.model)
        self._events: asyncio.Queue[dict[str, Any]] | None = None
        self._entry_id = ""
        self._submitted_at = 0.0
        self._first_token_at: float | None = None
        self._started = False  # some event came: a worker holds the request
        self._held: dict[str, Any] | None = None  # an event read by admitted(), still to be yielded
        self.prompt_tokens = 0  # from the worker's `started` event
        self.thinking = Thinking()  # splits a thinking model's deltas (the `started` event says whether)
        self._tail = Split()  # text the split held back until the end
        self._tokens_relayed = 0
        self._last_seq = -1  # of the last event relayed: a resume asks for what came after it
        self._resume = Resumption(gateway.config.resume_timeout)
        self._finished = False
        self._cancel_token = secrets.token_hex(
            16
        )  # only this gateway can cancel the request (protocol `cancel_digest`)
        # The request's trace: the worker continues it from the protocol's `trace` field.
        self.span = tracer.start_span(
            "lmq.gateway.request", attributes={"lmq.request_id": request.id, "lmq.model": request.model}
        )

    async def __aenter__(self) -> Generation:
        self.request = dataclasses.replace(
            self.request, trace=traceparent(self.span), cancel_digest=protocol.cancel_digest(self._cancel_token)
        )
        try:
            self._events = self.gateway.replies.open(self.request.id)
        except AlreadyOpen:
            error = duplicate()
            self._end_span(error)
            self.metrics.left(error)
            raise error from None
        try:
            self._entry_id = await self.gateway.queue.submit(self.request)
        except BaseException as exc:
            self.gateway.replies.close(self.request.id)
            self._end_span(exc)
            self.metrics.left(exc)
            raise
        self._submitted_at = time.monotonic()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        access_log.note(first_token_at=self._first_token_at, completion_tokens=self._tokens_relayed)
        rate_limits.count_tokens(self.prompt_tokens + self._tokens_relayed)  # finished or left midway
        self.gateway.replies.close(self.request.id)
        self._end_span(exc)
        self.metrics.left(exc)
        await asyncio.shield(self.gateway.queue.picked_up(self.request))  # its key's queue share, if still held
        if not self._finished:
            await asyncio.shield(self.gateway.queue.withdraw(self.request, self._entry_id, self._cancel_token))

    def _end_span(self, error: BaseException | None) -> None:
        self.span.set_attribute("lmq.completion_tokens", self._tokens_relayed)
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
        self.span.end()

    async def admitted(self, wait: float) -> bool:
        """Wait up to `wait` seconds for a worker to admit the request: True once it did, False while it
        still waits in the queue. A worker's refusal (prompt too long, an invalid schema) raises its
        ApiError here, so a handler can answer it with its HTTP status before sending any reply."""
        deadline = time.monotonic() + wait
        while self._held is None:
            event = await self._next_event(max(deadline - time.monotonic(), 0.0))
            if event is None:
                return False
            if event["type"] == "started":
                self._on_started(event)
                return True
            self._held = event  # a worker that sends no `started` (an older one): its first event admits
            if event["type"] == "error":
                self._finished = True
                raise self._worker_error(event)
        return True

    async def events(self, keepalive: float | None = None) -> AsyncIterator[Delta | Done | None]:
        try:
            while True:
                event, self._held = self._held or await self._next_event(keepalive), None
                if event is None:
                    yield None
                elif event["type"] == "started":
                    self._on_started(event)
                elif event["type"] == "delta":
                    delta = self._accept_delta(event)
                    if delta is not None:
                        yield delta
                elif event["type"] == "done":
                    done = self._finish(event)
                    if self._tail.content or self._tail.reasoning:
                        yield Delta(text=self._tail.content, token_ids=[], reasoning=self._tail.reasoning)
                    yield done
                    return
                elif event["type"] == "error":
                    self._finished = True
                    raise self._worker_error(event)
        except ApiError as error:  # counted here: a stream shows it to the client and leaves the block without it
            self.metrics.ended(error.label)
            raise

    async def result(self) -> tuple[str, Done]:
        """The whole text and the `done` (for non-streaming answers)."""
        text, _, done = await self.result_with_logprobs()
        return text, done

    async def result_with_logprobs(self) -> tuple[str, list[dict[str, Any]], Done]:
        texts, logprobs = [], []
        async for event in self.events():
            if isinstance(event, Delta):
                texts.append(event.text)
                logprobs += event.logprobs or []
            elif isinstance(event, Done):
                return "".join(texts), logprobs, event
        raise AssertionError("events() ends only after a Done or an error")

    def _on_started(self, event: dict[str, Any]) -> None:
        self.prompt_tokens = int(event.get("prompt_tokens", 0))
        self.thinking.started(event)

    def _worker_error(self, event: dict[str, Any]) -> ApiError:
        return ApiError.from_worker(str(event.get("code")), str(event.get("message")))

    async def _next_event(self, keepalive: float | None) -> dict[str, Any] | None:
        """The next event to relay; None when `keepalive` seconds passed without one. Resume markers
        and the events a resume makes redundant are handled here (gateway/resume.py)."""
        assert self._events is not None
        keepalive_at = None if keepalive is None else time.monotonic() + keepalive
        while True:
            now = time.monotonic()
            wake, why, problem = self._next_wake(now, keepalive_at)
            try:
                event = await asyncio.wait_for(self._events.get(), max(wake - now, 0.0))
            except TimeoutError:
                if why == "keepalive":
                    return None
                if why == "ask":
                    await self._ask_for_resume()
                elif why == "resume":
                    await self._resume_expired()
                elif not self._started and await self.gateway.queue.taken(self.request, self._entry_id):
                    await self._picked_up()  # a worker holds it, busy with other prompts: wait for the deadline
                else:
                    raise ApiError(504, problem, code="timeout") from None
                continue
            if not self._to_relay(event):
                continue
            if not self._started:
                await self._picked_up()
            self.metrics.event()
            return event

    def _next_wake(self, now: float, keepalive_at: float | None) -> tuple[float, str, str]:
        """When to stop waiting for an event, why, and the error to give if that is the deadline."""
        limit, problem = self._time_limit()
        wakes = [(limit, "deadline")]
        if keepalive_at is not None:
            wakes.append((keepalive_at, "keepalive"))
        if self._resume.until is not None:
            wakes.append((self._resume.until, "resume"))
        ask_in = self._resume.ask_in(now)
        if ask_in is not None:
            wakes.append((now + ask_in, "ask"))
        wake, why = min(wakes)
        return wake, why, problem

    def _to_relay(self, event: dict[str, Any]) -> bool:
        """Whether to relay an event from the queue (a resume marker or a redundant event is not)."""
        kind = event.get("type")
        if kind == INTERRUPTED:
            self._resume.interrupted(time.monotonic())
            return False
        if kind == RESUBSCRIBED:
            self._resume.resubscribed(time.monotonic())
            return False
        if kind == "resumed":
            self._resume.answered()
            return False
        if self._resume.active and not Resumption.in_order(event, self._last_seq, self._tokens_relayed):
            return False
        if kind != "delta" or int(event.get("offset", 0)) >= self._tokens_relayed:  # not a re-run's repeat
            self._last_seq = int(event.get("seq", self._last_seq))
        return True

    async def _ask_for_resume(self) -> None:
        self._resume.asked(time.monotonic())
        await ask_for_resume(self.gateway.redis, self.request, self._last_seq, self._tokens_relayed, self._cancel_token)

    async def _resume_expired(self) -> None:
        """No worker answered the resume in time. A request no worker had read needs none (it waits in
        the queue, nothing of it was lost); any other ends with the error it got before resuming existed."""
        if not self._started and not await self.gateway.queue.taken(self.request, self._entry_id):
            self._resume.answered()
            return
        raise ApiError.from_worker(LOST, GAVE_UP)  # leaving the block withdraws it, should its worker still run it

    async def _picked_up(self) -> None:
        self._started = True
        await self.gateway.queue.picked_up(self.request)

    def _time_limit(self) -> tuple[float, str]:
        """When to give up waiting for the next event, and the error to give then."""
        config = self.gateway.config
        deadline = self._submitted_at + config.request_timeout
        pickup = self._submitted_at + config.pickup_timeout
        if not self._started and pickup < deadline:
            return pickup, f"no worker started the request within {config.pickup_timeout:g} s"
        return deadline, f"the request did not finish within {config.request_timeout:g} s"

    def _accept_delta(self, event: dict[str, Any]) -> Delta | None:
        token_ids = list(event.get("token_ids") or [])
        gap = token_gap(event, self._tokens_relayed)
        if gap < 0:
            return None  # a re-run after a worker death repeating tokens already relayed
        if gap > 0:
            raise _lost(gap)
        self._tokens_relayed += len(token_ids)
        self.metrics.tokens(len(token_ids))
        if self._first_token_at is None:
            self.span.add_event("first_token")
            self._first_token_at = time.monotonic()
        logprobs = event.get("logprobs")
        piece = self.thinking.feed(str(event.get("text", "")), len(token_ids))
        return Delta(
            text=piece.content,
            token_ids=token_ids,
            logprobs=logprobs if isinstance(logprobs, list) else None,
            reasoning=piece.reasoning,
        )

    def _finish(self, event: dict[str, Any]) -> Done:
        self._finished = True
        if event.get("finish_reason") == "cancelled":
            raise ApiError(503, "the request was cancelled before it finished", code="cancelled")
        usage = event.get("usage") or {}
        completion_tokens = int(usage.get("completion_tokens", 0))
        if (gap := token_gap(event, self._tokens_relayed)) > 0:
            raise _lost(gap)
        self._tail = self.thinking.finish()
        done = Done(
            finish_reason=str(event.get("finish_reason")),
            stop_sequence=event.get("stop_sequence"),
            extra={key: event[key] for key in ("prompt_ids", "pieces", "max_context", "text") if key in event},
            usage=Usage(
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                completion_tokens=completion_tokens,
                cached_tokens=int(usage.get("cached_tokens", 0)),
                reasoning_tokens=self.thinking.tokens,
            ),
            reasoning=self.thinking.text,
        )
        self.prompt_tokens = done.usage.prompt_tokens or self.prompt_tokens  # a worker that sent no `started`
        self.metrics.done(done.finish_reason, done.usage.prompt_tokens, done.usage.completion_tokens)
        access_log.note(prompt_tokens=done.usage.prompt_tokens)
        return done


def _lost(tokens: int) -> ApiError:
    """Never relay an answer with a hole in it (events were lost between the worker and us)."""
    return ApiError(
        503, f"{tokens} tokens of the answer were lost on the way from the worker; retry", code="unavailable"
    )
