"""The token order rules shared by a live relay and a batch item's run (gateway/token_order.py)."""

from __future__ import annotations

from gateway.token_order import token_gap
from protocol import delta_event, done_event


def test_a_delta_follows_repeats_or_leaves_a_hole() -> None:
    assert token_gap(delta_event("r", 1, "ab", [1, 2], 3), taken=3) == 0
    assert token_gap(delta_event("r", 1, "ab", [1, 2], 1), taken=3) == -2  # a re-run repeating two tokens
    assert token_gap(delta_event("r", 1, "ab", [1, 2], 5), taken=3) == 2  # two tokens lost before it


def test_a_done_that_counts_more_tokens_than_arrived_leaves_a_hole() -> None:
    assert token_gap(done_event("r", 4, "stop", 7, 3, 0), taken=3) == 0
    assert token_gap(done_event("r", 4, "stop", 7, 5, 0), taken=3) == 2
    assert token_gap(done_event("r", 4, "stop", 7, 2, 0), taken=3) == 0  # never a repeat
