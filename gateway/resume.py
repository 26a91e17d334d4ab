"""One open request's way back after the reply subscription broke (protocol/resume.py).

The router (replies.py) tells each open request when its subscription broke (`INTERRUPTED`) and
when it is subscribed again (`RESUBSCRIBED`). From the break the request waits up to
`resume_timeout` seconds for its worker; once subscribed it asks on `lmq:resume` for every event
after the last one it relayed, and asks again each RETRY_S until the worker's `resumed` event
comes (a worker re-subscribing after the same fault may miss the first ask). Until then events are
taken only in order: one already relayed (its `seq` at or below the last relayed) is dropped, and
so is one that would leave a hole (a delta past the relayed tokens, a `done` that counts more),
since the worker sends it again after the ones before it. No answer within the bound: the client
gets the `unavailable` error it got before resuming existed.

A reader of a durable reply stream (a batch item's run: gateway/batches/item_run.py; a background
response: gateway/responses/background.py) resumes by the same rules (`StreamOrder`, `ask_for`):
after its connection broke, and when its stream shows a hole (entries lost with Redis's data).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

import protocol
from protocol.resume import RESUME_CHANNEL, resume_message

from .token_order import token_gap

log = logging.getLogger(__name__)

INTERRUPTED = "lmq.interrupted"  # router-made event types: never on the wire (workers send no dotted type)
RESUBSCRIBED = "lmq.resubscribed"
RETRY_S = 1.0
TAKE, DROP, LOST = "take", "drop", "lost"  # StreamOrder.admit's verdicts
GAVE_UP = "the connection to the request queue broke while the request ran; part of its answer may be lost: retry"


def marker(kind: str, request_id: str) -> dict[str, Any]:
    return {"type": kind, "id": request_id}


class Resumption:
    """The resume state of one request; `now` is time.monotonic()."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.until: float | None = None  # resuming until then; None = not resuming
        self._ask_at: float | None = None  # when to ask (again); None = not subscribed yet

    @property
    def active(self) -> bool:
        return self.until is not None

    def interrupted(self, now: float) -> None:
        if self.until is None:
            self.until = now + self.timeout
        self._ask_at = None

    def resubscribed(self, now: float) -> None:
        if self.until is None:  # a break noticed only by a second subscription: events may be lost all the same
            self.until = now + self.timeout
        self._ask_at = now

    def ask_in(self, now: float) -> float | None:
        """Seconds until the next ask (0: now), None when none is due."""
        return None if self.until is None or self._ask_at is None else max(self._ask_at - now, 0.0)

    def asked(self, now: float) -> None:
        self._ask_at = now + RETRY_S

    def answered(self) -> None:
        self.until = self._ask_at = None

    @staticmethod
    def in_order(event: dict[str, Any], last_seq: int, relayed: int) -> bool:
        """Whether an event may be relayed while resuming: new, and leaving no hole."""
        if int(event.get("seq", 0)) <= last_seq:
            return False
        if event.get("type") == "delta":
            return int(event.get("offset", 0)) == relayed
        if event.get("type") == "done":
            return int((event.get("usage") or {}).get("completion_tokens", 0)) <= relayed
        return True


async def ask(redis: aioredis.Redis, request: protocol.Request, seq: int, offset: int, token: str) -> None:
    """Ask the request's worker for every event after `seq` (a failed ask is retried by the caller's loop)."""
    await ask_for(redis, request.id, seq, offset, token)


async def ask_for(redis: aioredis.Redis, request_id: str, seq: int, offset: int, token: str | None = None) -> None:
    """`ask` by the request's id; `token` None for a request that names no cancel digest (a batch item's)."""
    try:
        await redis.publish(RESUME_CHANNEL, resume_message(request_id, seq, offset, token))
    except RedisError as exc:
        log.info("request_id=%s: could not ask for a resume yet (%s)", request_id, exc)


class StreamOrder:
    """Which events of a durable reply stream its reader takes, by the resume rules: an event at or
    below the last `seq` taken is one it has (read again, or sent again) and is dropped; a hole (a
    delta or a `done` past the tokens taken) starts a resume and is dropped, and while resuming only
    events in order are taken, until the worker's `resumed`. The reader asks when `due_ask` says, and
    a hole no `resumed` filled within the bound (`expired`), or an `unavailable` error while resuming
    (the worker no longer keeps the events), is a loss."""

    def __init__(self, timeout: float):
        self.resume = Resumption(timeout)
        self.last_seq = -1  # of the last event taken: a resume asks for what came after it
        self.holed = False  # a hole was seen that no `resumed` has filled yet

    def admit(self, event: dict[str, Any], tokens: int) -> str:
        """TAKE, DROP or LOST for the next event, `tokens` the completion tokens taken so far."""
        kind = event.get("type")
        if kind == "resumed":
            self.resume.answered()
            self.holed = False
            return DROP
        if int(event.get("seq", 0)) <= self.last_seq:
            return DROP
        if self.resume.active and not Resumption.in_order(event, self.last_seq, tokens):
            return DROP  # the worker sends it again after the ones before it
        if kind == "error" and self.resume.active and event.get("code") == "unavailable":
            return LOST
        if kind in ("delta", "done") and token_gap(event, tokens) > 0:
            self.resume_now()  # entries lost with Redis's data: ask the worker for them
            self.holed = True
            return DROP
        if kind != "delta" or int(event.get("offset", 0)) >= tokens:  # not a re-run's repeat
            self.last_seq = int(event.get("seq", self.last_seq))
        return TAKE

    def lost_touch(self) -> None:
        """The connection broke: events may be lost; wait, up to the bound, to be connected again."""
        self.resume.interrupted(time.monotonic())

    def resume_now(self) -> None:
        """Connected again, or a hole seen: resume (within the bound a break started), asking at once."""
        self.resume.resubscribed(time.monotonic())

    def due_ask(self) -> bool:
        """Whether to ask the worker (again) now; if so, the ask counts as made."""
        now = time.monotonic()
        if self.resume.ask_in(now) != 0.0:
            return False
        self.resume.asked(now)
        return True

    def expired(self) -> bool:
        """Past the bound without a `resumed`: True if a hole was seen (a loss). Else nothing was lost
        that the reader knows of (no worker held the request, or one that died: claims go on): it
        stops resuming and reads on."""
        if not self.resume.active or time.monotonic() < (self.resume.until or 0.0):
            return False
        self.resume.answered()
        return self.holed
