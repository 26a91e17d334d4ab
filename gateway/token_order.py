"""The order rules of a request's token stream, for whoever reads its events: a live client's relay
(gateway/generation.py), a batch item's run (gateway/batches/item_run.py) and a background response
(gateway/responses/background.py) apply the same ones.

A worker sends each delta with its `offset`, the completion tokens sent before it. A delta whose
offset is below the tokens already taken repeats them (a re-run after a worker death) and is
dropped; one above it, or a `done` that counts more completion tokens than arrived, means events
were lost on the way. An answer with such a hole is never relayed, nor written as a result.
"""

from __future__ import annotations

from typing import Any


def token_gap(event: dict[str, Any], taken: int) -> int:
    """Where `event` (a delta or a done) stands after `taken` completion tokens: 0 when it follows
    them, below 0 for a delta repeating tokens already taken, above 0 by how many tokens were lost."""
    if event.get("type") == "done":
        return max(int((event.get("usage") or {}).get("completion_tokens", 0)) - taken, 0)
    return int(event.get("offset", 0)) - taken
