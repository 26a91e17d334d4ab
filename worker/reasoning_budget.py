"""Thinking models: whether a prompt thinks, and the budget that closes a thinking block in time.

A chat template that writes `<think>` (Qwen3's, QwQ's, the DeepSeek-R1 distills') belongs to a
model that may think before it answers. `thinking_of` reads the rendered prompt's last tokens:

- it ends inside an opened block (QwQ and R1 end the generation prompt with `<think>\n`): the
  output begins inside the thinking (`open`);
- it ends with a closed block (Qwen3 under `enable_thinking: false` writes an empty one): this
  turn does not think, and nothing is split or budgeted;
- otherwise the model may open a block at the start of its output.

`ThinkingBudget` is one sequence's token constraint, applied by the sampler like a grammar
(worker/sampler.py): it follows the tokens, counts those inside the block, and once the request's
`reasoning_budget` is spent it forces the closing tag's tokens one by one (every other token's
logit -inf), as llama-server's --reasoning-budget does; the answer follows. Budget 0 closes a block
as soon as it opens. The forcing overrides a request's grammar: a grammar that does not allow the
closing tag there ends the sequence with an error (constrained output and thinking rarely mix: a
JSON grammar never lets the block open).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.token_bytes import token_bytes

if TYPE_CHECKING:
    from worker.model.loader import LoadedModel

START, END = "<think>", "</think>"
CLOSING = "\n" + END + "\n\n"  # what a forced close writes: the answer starts on a fresh paragraph
PROMPT_TAIL_TOKENS = 16  # enough of the prompt's end to hold the generation prompt and a tag

BEFORE, THINKING, DONE = "before", "thinking", "done"


@dataclass(frozen=True)
class Thinking:
    """A prompt whose answer may think: its tags, and whether the prompt opened the block."""

    start: str
    end: str
    open: bool

    def event_field(self) -> dict[str, object]:
        """The `started` event's `reasoning` map (docs/protocol.md)."""
        return {"start": self.start, "end": self.end, "open": self.open}


def template_thinks(source: str) -> bool:
    return START in source and END in source


def thinking_of(model: LoadedModel, prompt_ids: Sequence[int]) -> Thinking | None:
    """How a chat prompt's answer thinks, or None where it does not (a template without `<think>`)."""
    if not template_thinks(model.chat_template.source):
        return None
    tail = model.tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
    last = max(tail.rfind(START), tail.rfind(END))  # a tag followed by more text is an earlier turn's
    if last < 0 or tail[last:].rstrip() not in (START, END):
        return Thinking(START, END, open=False)
    if tail[last:].startswith(END):
        return None  # this turn's block is already written (and empty): it does not think
    return Thinking(START, END, open=True)


class ThinkingBudget:
    """One sequence's thinking: the tokens inside counted, the close forced once `budget` are spent."""

    def __init__(self, model: LoadedModel, thinking: Thinking, budget: int, replay: Sequence[int] = ()) -> None:
        self._bytes = token_bytes(model.tokenizer)
        self._start, self._end = thinking.start.encode(), thinking.end.encode()
        self._closing = model.tokenizer.encode(CLOSING, add_special_tokens=False).ids
        self.budget = budget
        self.state = THINKING if thinking.open else BEFORE
        self.used = 0  # tokens inside the block
        self._text = b""  # the output's start (BEFORE) or the block's last bytes (THINKING): where tags are found
        self._forcing: list[int] = []
        for token in replay:  # a takeover continues where the first run was, forced tokens included
            self.forced()
            self.record(token)

    def forced(self) -> int | None:
        """The token the next step must take, or None to sample freely."""
        if not self._forcing and self.state == THINKING and self.used >= self.budget:
            self._forcing = list(self._closing)
        return self._forcing[0] if self._forcing else None

    def record(self, token_id: int) -> None:
        if self._forcing and token_id == self._forcing[0]:
            self._forcing.pop(0)
            if not self._forcing:
                self.state = DONE
            return
        self._forcing = []
        piece = self._bytes[token_id] if token_id < len(self._bytes) else b""
        if self.state == BEFORE:
            self._text += piece
            lead = self._text.lstrip()
            if lead.startswith(self._start):
                self.state, self._text = THINKING, lead[len(self._start) :]
            elif not self._start.startswith(lead):
                self.state = DONE  # the output does not open a block: nothing to count
        elif self.state == THINKING:
            self.used += 1
            self._text = (self._text + piece)[-(len(self._end) + len(piece)) :]
            if self._end in self._text:
                self.state = DONE


def budget_for(
    model: LoadedModel, thinking: Thinking | None, budget: int | None, replay: Sequence[int] = ()
) -> ThinkingBudget | None:
    """A sequence's budget, where it thinks and has one."""
    if thinking is None or budget is None:
        return None
    return ThinkingBudget(model, thinking, budget, replay)
