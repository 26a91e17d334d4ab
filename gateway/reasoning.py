"""A thinking model's output split into its reasoning and its answer, delta by delta.

Thinking models (Qwen3, QwQ, the DeepSeek-R1 distills) write `<think>reasoning</think>answer`.
Whether a model thinks is its chat template's business, not its name's: the worker renders the
prompt and says so in the `started` event (`reasoning: {start, end, open}`, docs/protocol.md),
`open` when the prompt itself opened the block (QwQ's and R1's templates end the generation
prompt with `<think>\n`, so the output begins inside the thinking and only closes it).

`ReasoningSplit` is fed the text deltas as they come and returns, for each, the reasoning and the
answer text it can release. A tag may arrive cut across deltas (`</thi` + `nk>`): text that may
still become a tag is held back until it is one or is not. The rules are llama-server's:

- the block opens only at the start of the output (after blank space); a `<think>` later in an
  answer is answer text;
- blank space at both ends of the reasoning, and at the start of the answer, is dropped;
- an output that ends inside the block (max_tokens) has only reasoning; an output that never
  opens one is all answer.
"""

from __future__ import annotations

from dataclasses import dataclass

BEFORE, THINKING, AFTER_CLOSE, ANSWER = "before", "thinking", "after_close", "answer"


@dataclass(frozen=True)
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningSplit:
    def __init__(self, start: str = "<think>", end: str = "</think>", open: bool = False) -> None:
        self.start, self.end = start, end
        self.state = THINKING if open else BEFORE
        self._held = ""  # text not released yet: a possible tag, or blank space whose side is unknown
        self._reasoning_begun = False  # the reasoning's leading blank space is dropped until it has begun

    @property
    def thinking(self) -> bool:
        """Inside the block (or about to know whether it opens one): the tokens count as reasoning."""
        return self.state == THINKING

    def feed(self, text: str) -> Split:
        self._held += text
        reasoning, content = [], []
        while True:
            if self.state == BEFORE:
                lead = self._held.lstrip()
                if lead.startswith(self.start):
                    self.state, self._held = THINKING, lead[len(self.start) :]
                    continue
                if self.start.startswith(lead):
                    break  # blank space, or the tag's beginning: wait for more
                self.state = ANSWER
            elif self.state == THINKING:
                end = self._held.find(self.end)
                if end >= 0:
                    reasoning.append(self._reasoning(self._held[:end].rstrip()))
                    self.state, self._held = AFTER_CLOSE, self._held[end + len(self.end) :]
                    continue
                keep = _partial_suffix(self._held, self.end)
                ready = self._held[: len(self._held) - keep]
                core = ready.rstrip()  # trailing blank space waits: it may be the last before the tag
                reasoning.append(self._reasoning(core))
                self._held = self._held[len(core) :]
                break
            elif self.state == AFTER_CLOSE:
                self._held = self._held.lstrip()
                if not self._held:
                    break
                self.state = ANSWER
            else:
                content.append(self._held)
                self._held = ""
                break
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """The end of the output: what was held back goes where it belongs."""
        held, self._held = self._held, ""
        if self.state == THINKING:
            return Split(self._reasoning(held.rstrip()), "")
        if self.state in (BEFORE, ANSWER):
            return Split("", held)
        return Split()

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_begun:
            text = text.lstrip()
            self._reasoning_begun = bool(text)
        return text


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may become the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class Thinking:
    """One generation's thinking, as the gateway relays it (gateway/generation.py): every delta is all
    answer until the worker's `started` event says the answer thinks (its `reasoning` map); from then on
    each is split, the reasoning kept whole for the `done` and its tokens counted (a delta's tokens count
    when it began or ended inside the block, its tags and blank space before the opening one included)."""

    def __init__(self) -> None:
        self._split: ReasoningSplit | None = None
        self._reasoning: list[str] = []
        self.tokens = 0
        self._undecided = 0

    def started(self, event: dict) -> None:
        tags = event.get("reasoning")
        if isinstance(tags, dict) and isinstance(tags.get("start"), str) and isinstance(tags.get("end"), str):
            self._split = ReasoningSplit(tags["start"], tags["end"], open=bool(tags.get("open")))

    def feed(self, text: str, tokens: int) -> Split:
        if self._split is None:
            return Split(content=text)
        inside = self._split.thinking
        piece = self._split.feed(text)
        if inside or self._split.thinking:
            self.tokens += tokens + self._undecided
            self._undecided = 0
        elif self._split.state == BEFORE:
            self._undecided += tokens  # blank space or the tag's beginning: thinking if the tag completes
        else:
            self._undecided = 0
        self._reasoning.append(piece.reasoning)
        return piece

    def finish(self) -> Split:
        if self._split is None:
            return Split()
        piece = self._split.finish()
        self._reasoning.append(piece.reasoning)
        return piece

    @property
    def text(self) -> str:
        return "".join(self._reasoning)
