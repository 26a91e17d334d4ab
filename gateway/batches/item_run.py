"""One run of one batch item: its events read from its reply stream, folded into an answer or an end.

The token order rules are those a live client's relay follows (gateway/token_order.py): a repeated
delta is dropped, and a hole means events were lost. The reply stream is durable, so a gateway that
takes over a batch reads each run from the stream's start and gets the same; an event whose `seq`
is at or below the last one taken is one the run has (read again, or sent again) and is dropped.

A stream loses entries only with Redis's data (a promoted replica that lacked the old primary's
last writes, a restart that lost the last second of its file). The run then resumes as a live
relay does (gateway/resume.py's `StreamOrder`, docs/protocol.md "Resuming after a broken
subscription"): its worker is asked for every event after the last one taken (the runner publishes
the ask), events are taken only in order until the worker's `resumed` event, and only when no
`resumed` comes within the resume bound is a hole a loss. A lost answer is never written as a
result: the runner runs the item again.

A thinking model's text is split as the live relay splits it (gateway/reasoning.py, `Thinking`: the
`started` event says whether and how the answer thinks), so `answer` holds the answer's text and
its thinking apart, what the item's outcome records and its rendered answer shows (items.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..reasoning import Thinking
from ..resume import DROP, LOST, StreamOrder
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
    order: StreamOrder = field(default_factory=lambda: StreamOrder(RESUME_S))
    ended: Ended | None = None  # how it ended, once folded (kept until its outcome is written)

    def feed(self, event: dict[str, Any]) -> Ended | None:
        """Take one event from the reply stream; how the run ended, once it has."""
        self.heard_at = time.monotonic()
        verdict = self.order.admit(event, self.tokens)
        if verdict == LOST:
            return Ended("lost")  # the worker no longer keeps what is missing: run the item again
        if verdict == DROP:
            return None
        kind = event.get("type")
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

    def reconnected(self) -> None:
        """Redis answers again after an outage: resume, asking the worker at once."""
        self.order.resume_now()
        self.heard_at = time.monotonic()  # silent through the outage: not a run whose entry vanished

    def resume_expired(self) -> Ended | None:
        """Past the resume bound with a hole no worker filled: lost (see StreamOrder.expired)."""
        return Ended("lost") if self.order.expired() else None

    @property
    def resuming(self) -> bool:
        return self.order.resume.active

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
