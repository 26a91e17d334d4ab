"""Where the outside reference for the default model lives (shared/ beside the checkout, as CI lays it)."""

from __future__ import annotations

import json
import pathlib

import pytest

REFERENCE_NAME = "smollm2-greedy.json"
REFERENCE_DIRS = [pathlib.Path(__file__).resolve().parents[2] / "shared" / "reference", pathlib.Path("/work/shared/reference")]


def load_reference() -> dict:
    """The reference JSON; skips the calling test, naming where it looked, when it is absent."""
    for directory in REFERENCE_DIRS:
        if (directory / REFERENCE_NAME).exists():
            return json.loads((directory / REFERENCE_NAME).read_text())
    pytest.skip(f"{REFERENCE_NAME} not found in {[str(d) for d in REFERENCE_DIRS]}")


NEAR_TIE = 0.05  # the reference's rule: greedy ids must agree up to the first step with a smaller top-2 margin


def comparable_steps(chat: dict) -> int:
    """How many of a chat case's greedy ids a float32 run must reproduce exactly."""
    margins = chat["top2_margins"]
    return next((step for step, margin in enumerate(margins) if margin < NEAR_TIE), len(margins))
