"""The engine on the real default model (SmolLM2-135M-Instruct, float32) against reference greedy ids."""

from __future__ import annotations

import pytest

from protocol import SamplingParams
from tests.support.engine_runs import generate, greedy
from tests.support.reference_data import comparable_steps, load_reference
from worker.engine import GenRequest
from worker.model.loader import LoadedModel
from worker.prompt import build_prompt_ids

# Real work: 13 s on 2 idle cores, over 100 s with the cores busy. A hang fails sooner, in
# engine_runs' watchdog (no engine step for STALL_TIMEOUT_S); pytest-timeout's 300 s would cut a slow
# machine's honest run.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def model(default_model: LoadedModel) -> LoadedModel:
    """The session's float32 default model (tests/conftest.py): engines only read a model's weights."""
    return default_model


@pytest.fixture(scope="module")
def chats() -> list[dict]:
    return load_reference()["chat"]


def reference_greedy(model: LoadedModel, max_tokens: int) -> SamplingParams:
    """Greedy with the end-of-turn tokens masked, as the reference generated (min_new_tokens)."""
    return greedy(max_tokens=max_tokens, logit_bias={token: -100.0 for token in model.stop_token_ids})


async def test_batched_greedy_output_matches_the_reference(model: LoadedModel, chats: list[dict]) -> None:
    requests = []
    for index, chat in enumerate(chats):
        ids = build_prompt_ids(model, messages=chat["messages"], max_tokens=32, truncate=False)
        assert ids == chat["prompt_ids"]
        requests.append(GenRequest(f"chat{index}", ids, reference_greedy(model, len(chat["greedy_ids"]))))
    results = await generate(model, requests, joins={"chat3": 4}, step_tokens=48)
    for index, chat in enumerate(chats):
        steps = comparable_steps(chat)
        assert steps > 0
        assert results[f"chat{index}"].token_ids[:steps] == chat["greedy_ids"][:steps]


async def test_prefix_cache_hit_matches_the_reference(model: LoadedModel, chats: list[dict]) -> None:
    chat = chats[0]
    requests = [GenRequest(name, chat["prompt_ids"], reference_greedy(model, 16)) for name in ("cold", "warm")]
    results = await generate(model, requests, joins={"warm": "cold"})
    steps = min(comparable_steps(chat), 16)
    assert results["warm"].cached_tokens == (len(chat["prompt_ids"]) - 1) // 16 * 16 > 0
    assert results["warm"].token_ids[:steps] == results["cold"].token_ids[:steps] == chat["greedy_ids"][:steps]
    assert results["cold"].text.startswith(chat["greedy_text"][:20])
