"""A forced tool-call turn ends when the model writes a call it already wrote.

Under a `tool_calls` constraint that allows parallel calls, the grammar lets the output end (EOS)
after every complete call, or begin another. A model that was never taught the format (the
default SmolLM2, shown the tools in a Hermes system prompt) seldom takes the end: it writes the same
call again and again until max_tokens (issue 29). A call identical to an earlier one (same name,
same arguments) is nothing a client can use — the gateway drops it — so the output ends there.

`RepeatWatch` follows one sequence's output bytes and says when a call just completed that repeats
an earlier one; the grammar matcher (worker/grammar.py) then counts as finished, and the engine
ends the sequence (`stop`) as it ends any complete grammar.
"""

from __future__ import annotations

import json
from typing import Any

OPEN, CLOSE = b"<tool_call>", b"</tool_call>"


class RepeatWatch:
    def __init__(self, token_bytes: list[bytes]) -> None:
        self._bytes = token_bytes
        self._output = b""
        self._seen: list[Any] = []
        self.repeated = False

    def push(self, token_id: int) -> bool:
        """Follow one more output token; True once a call repeats an earlier one."""
        if self.repeated or token_id >= len(self._bytes):
            return self.repeated
        piece = self._bytes[token_id]
        self._output += piece
        closed = self._output.find(CLOSE, max(len(self._output) - len(piece) - len(CLOSE), 0))
        if closed < 0:
            return False
        opened = self._output.rfind(OPEN, 0, closed)
        call = _parsed(self._output[opened + len(OPEN) : closed]) if opened >= 0 else None
        self._output = self._output[closed + len(CLOSE) :]
        if call is not None:
            self.repeated = call in self._seen
            self._seen.append(call)
        return self.repeated


def _parsed(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None
