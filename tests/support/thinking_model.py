"""A thinking model for tests: a tiny random Qwen3 under the real Qwen3 chat template, and the
constraint that scripts its output (random weights think nothing on their own).

The template is what makes it think (the worker reads the `<think>` tags from it and says so in its
`started` event); the regex `THINK_THEN_ANSWER` makes its greedy output a run of letters inside the
block, then the answer "Paris.". The APIs take no regex of their own, so a test swaps it in for the
structured-output parser (gateway/openai.py `parse_response_format`, gateway/anthropic.py
`parse_output_format`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from collections.abc import AsyncIterator

import pytest

from gateway import anthropic as anthropic_api
from gateway import openai as openai_api
from tests.support.gateway_harness import real_worker, running_gateway
from tests.support.tiny_families import FAMILY_BY_NAME, make_family_model
from worker.model.loader import LoadedModel, load_model

CHAT_TEMPLATES = pathlib.Path(__file__).parents[1] / "worker" / "model" / "chat_templates"
QWEN3_TEMPLATE = CHAT_TEMPLATES / "Qwen-Qwen3-0.6B.jinja"
# The script: a run of these letters inside the block (the budget may close it), then the answer.
THINK_THEN_ANSWER = {"type": "regex", "pattern": r"<think>\n[ ok]{1,40}\n</think>\n\nParis\."}
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


def make_tiny_qwen3(directory: pathlib.Path) -> LoadedModel:
    """The tiny random Qwen3 (512 positions) with the real Qwen3 template, loaded in float32."""
    family = FAMILY_BY_NAME["qwen3"]
    spec = dataclasses.replace(family, config={**family.config, "max_position_embeddings": 512})
    template = QWEN3_TEMPLATE.read_text(encoding="utf-8")
    make_family_model(spec, directory, chat_template=template)
    return load_model(str(directory), dtype="float32", quant="none", device="cpu")


@contextlib.asynccontextmanager
async def thinking_service(redis_url: str, model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """A real worker serving `model` and a gateway, every answer's constraint swapped for THINK_THEN_ANSWER
    (the APIs take no regex of their own); yields the gateway's URL."""
    monkeypatch.setattr(openai_api, "parse_response_format", lambda body: THINK_THEN_ANSWER)
    monkeypatch.setattr(anthropic_api, "parse_output_format", lambda body: THINK_THEN_ANSWER)
    async with real_worker(redis_url, model, kv_memory="16MiB"), running_gateway(redis_url) as url:
        yield url
