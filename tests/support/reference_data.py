"""Where the outside reference for the default model lives (shared/ beside the checkout, as CI lays it)."""

from __future__ import annotations

import json

import pytest

from bench.engine.quality import REFERENCE_DIRS, REFERENCE_NAME, find_reference


def load_reference() -> dict:
    """The reference JSON; skips the calling test, naming where it looked, when it is absent."""
    path = find_reference()
    if path is None:
        pytest.skip(f"{REFERENCE_NAME} not found in {[str(d) for d in REFERENCE_DIRS]}")
    return json.loads(path.read_text())


NEAR_TIE = 0.05  # the reference's rule: greedy ids must agree up to the first step with a smaller top-2 margin


def comparable_steps(chat: dict) -> int:
    """How many of a chat case's greedy ids a float32 run must reproduce by the reference's own rule."""
    margins = chat["top2_margins"]
    return next((step for step, margin in enumerate(margins) if margin < NEAR_TIE), len(margins))
