"""One run of one batch item: its events read from its reply stream, folded into an answer or an end.

The token order rules are those a live client's relay follows (gateway/token_order.py): a repeated
delta is dropped, and a hole means events were lost. The reply stream is durable, so a gateway that
takes over a batch reads each run from the stream's start and gets the same; an event whose `seq`
is at or below the last one taken is one the run has (read again, or sent again) and is dropped.

A stream loses entries only with Redis's data (a promoted replica that lacked the old primary's
last writes, a restart that lost the last second of its file). The run then resumes as a live
relay does (gateway/resume.py, docs/protocol.md "Resuming after a broken subscription"): its worker
is asked for every event after the last one taken (`due_ask`, the runner publishes it), events are
taken only in order until the worker's `resumed` event, and only when no `resumed` comes within
the resume bound is a hole a loss. A lost answer is never written as a result: the runner runs the
item again.

A thinking model's text is split as the live relay splits it (gateway/reasoning.py, `Thinking`: the
`started` event says whether and how the answer thinks), so `answer` holds the answer's text and
its thinking apart, what the item's outcome records and its rendered answer shows (items.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..reasoning import Thinking
from ..resume import Resumption
from ..token_order import token_gap

RESUME_S = 15.0  # the gateway's default resume_timeout; the runner gives each run its own setting


@dataclass(frozen=True)
class Ended:
    """How a run ended: `done` (the worker's event), `error` (its event), or `lost` (a hole no resume
    filled, a gap the worker could no longer fill, or a vanished entry)."""

    how: str
    event: dict[str, Any] = field(default_factory=dict)


@dataclass
class ItemRun:
    index: int
    attempt: int
    stream: str  # the request stream holding its entry
    entry_id: str
    reply_key: str
    request_id: str
    cursor: str = "0-0"  # the last reply stream entry read
    contents: list[str] = field(default_factory=list)  # the answer's text (a thinking model's thinking apart)
    thinking: Thinking = field(default_factory=Thinking)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0  # completion tokens taken
    heard_at: float = field(default_factory=time.monotonic)  # the last event (or the start)
    withdrawn: bool = False
    last_seq: int = -1  # of the last event taken: a resume asks for what came after it
    resume: Resumption = field(default_factory=lambda: Resumption(RESUME_S))
    holed: bool = False  # a hole was seen: unless a resume fills it, the run's events are lost
    ended: Ended | None = None  # how it ended, once folded (kept until its outcome is written)

    def feed(self, event: dict[str, Any]) -> Ended | None:
        """Take one event from the reply stream; how the run ended, once it has."""
        self.heard_at = time.monotonic()
        kind = event.get("type")
        if kind == "resumed":
            self.resume.answered()
            self.holed = False
            return None
        if int(event.get("seq", 0)) <= self.last_seq:
            return None  # one this run has: read again after a reconnect, or sent again by a resume
        if self.resume.active and not Resumption.in_order(event, self.last_seq, self.tokens):
            return None  # the worker sends it again after the ones before it
        if kind == "error" and self.resume.active and event.get("code") == "unavailable":
            return Ended("lost")  # the worker no longer keeps what is missing: run the item again
        if kind in ("delta", "done") and token_gap(event, self.tokens) > 0:
            self.resume_now()  # entries lost with Redis's data: ask the worker for them
            self.holed = True
            return None
        if kind != "delta" or int(event.get("offset", 0)) >= self.tokens:  # not a re-run's repeat
            self.last_seq = int(event.get("seq", self.last_seq))
        if kind == "delta":
            self._delta(event)
            return None
        if kind == "done":
            self.contents.append(self.thinking.finish().content)
            return Ended("done", event)
        if kind == "error":
            return Ended("error", event)
        if kind == "started":
            self.thinking.started(event)
        return None  # and kinds a later worker may add

    def lost_touch(self) -> None:
        """The connection to Redis broke: the run waits, up to the resume bound, to be asked for."""
        self.resume.interrupted(time.monotonic())

    def resume_now(self) -> None:
        """Connected again, or a hole seen: resume (within the bound the break started), asking at once."""
        self.resume.resubscribed(time.monotonic())
        self.heard_at = time.monotonic()  # silent through the outage: not a run whose entry vanished

    def due_ask(self) -> bool:
        """Whether to ask the worker (again) now; if so, the ask counts as made."""
        now = time.monotonic()
        if self.resume.ask_in(now) != 0.0:
            return False
        self.resume.asked(now)
        return True

    def resume_expired(self) -> Ended | None:
        """Past the resume bound without a `resumed`: a hole seen is a loss; else nothing was lost
        that the run knows of (no worker held it, or one that died: the claims go on), and it reads on."""
        if not self.resume.active or time.monotonic() < (self.resume.until or 0.0):
            return None
        self.resume.answered()
        return Ended("lost") if self.holed else None

    def _delta(self, event: dict[str, Any]) -> None:
        token_ids = list(event.get("token_ids") or [])
        if token_gap(event, self.tokens) < 0:
            return  # a re-run after a worker death repeating tokens already taken
        self.tokens += len(token_ids)
        text = str(event.get("text", ""))
        self.contents.append(self.thinking.feed(text, len(token_ids)).content)
        if isinstance(event.get("logprobs"), list):
            self.logprobs += event["logprobs"]

    @property
    def answer(self) -> dict[str, Any]:
        """A run that ended `done` as the outcome's fields: the answer's text, a thinking model's
        thinking and its tokens apart from it (as Done.reasoning and usage.reasoning_tokens live), and
        the logprobs. A model that does not think has `text` the whole text, no thinking, 0 tokens."""
        return {
            "text": "".join(self.contents),
            "reasoning": self.thinking.text,
            "reasoning_tokens": self.thinking.tokens,
            "logprobs": self.logprobs,
        }
