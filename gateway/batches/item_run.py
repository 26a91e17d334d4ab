"""One run of one batch item: its events read from its reply stream, folded into an answer or an end.

The token order rules are those a live client's relay follows (gateway/token_order.py): a repeated
delta is dropped, and a hole means events were lost. A lost answer is never written as a result:
the runner runs the item again. The reply stream is durable,
so a gateway that takes over a batch reads each run from the stream's start and gets the same.

A thinking model's text is split as the live relay splits it (gateway/reasoning.py, `Thinking`: the
`started` event says whether and how the answer thinks), so `answer` holds the answer's text and
its thinking apart, what the item's outcome records and its rendered answer shows (items.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..reasoning import Thinking
from ..token_order import token_gap


@dataclass(frozen=True)
class Ended:
    """How a run ended: `done` (the worker's event), `error` (its event), or `lost` (a hole, or a vanished entry)."""

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

    def feed(self, event: dict[str, Any]) -> Ended | None:
        self.heard_at = time.monotonic()
        kind = event.get("type")
        if kind == "delta":
            return self._delta(event)
        if kind == "done":
            if token_gap(event, self.tokens) > 0:
                return Ended("lost")
            self.contents.append(self.thinking.finish().content)
            return Ended("done", event)
        if kind == "error":
            return Ended("error", event)
        if kind == "started":
            self.thinking.started(event)
        return None  # and kinds a later worker may add

    def _delta(self, event: dict[str, Any]) -> Ended | None:
        token_ids = list(event.get("token_ids") or [])
        gap = token_gap(event, self.tokens)
        if gap < 0:
            return None
        if gap > 0:
            return Ended("lost")
        self.tokens += len(token_ids)
        text = str(event.get("text", ""))
        self.contents.append(self.thinking.feed(text, len(token_ids)).content)
        if isinstance(event.get("logprobs"), list):
            self.logprobs += event["logprobs"]
        return None

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
