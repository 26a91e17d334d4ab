"""The logprobs of a delta as the protocol sends them: per token its text, bytes and logprob, and the alternatives.

A token that is not valid UTF-8 on its own (a piece of a multi-byte character) is written as
OpenAI writes it: `bytes:` and the escaped bytes; `bytes` always holds the exact bytes.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from worker.token_bytes import token_bytes


class LogprobEvents:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, logprobs: list[Any]) -> list[dict[str, Any]]:
        """TokenLogprobs (worker/engine.py) → `[{id, token, bytes, logprob, top: [{id, token, bytes, logprob}]}]`."""
        return [
            self._token(entry.token_id, entry.logprob) | {"top": [self._token(i, lp) for i, lp in entry.top]}
            for entry in logprobs
        ]

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        table = token_bytes(self.tokenizer)
        raw = table[token_id] if 0 <= token_id < len(table) else b""
        return {"id": token_id, "token": token_string(raw), "bytes": raw, "logprob": float(logprob)}


def token_string(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
