"""worker/reasoning_budget.py: which prompts think (read from the real templates), and the budget that
closes a thinking block in the worker, forced token by token, resumed after a takeover."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from tests.support.engine_runs import generate, greedy
from worker.engine import GenRequest
from worker.model.chat_template import ChatTemplate
from worker.model.loader import LoadedModel
from worker.prompt import build_prompt_ids
from worker.reasoning_budget import CLOSING, PROMPT_TAIL_TOKENS, Thinking, thinking_of
from worker.stub_model import stub_model

TEMPLATES = pathlib.Path(__file__).parent / "model" / "chat_templates"
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


def _with_template(model: LoadedModel, name: str) -> LoadedModel:
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return dataclasses.replace(model, chat_template=ChatTemplate(source, eos_token="<|im_end|>"))


def _thinking(model: LoadedModel, **template_kwargs) -> Thinking | None:
    ids = build_prompt_ids(model, messages=QUESTION, max_tokens=8, truncate=False, template_kwargs=template_kwargs)
    return thinking_of(model, ids)


def test_the_template_says_whether_and_how_the_answer_thinks(tiny: LoadedModel) -> None:
    qwen3, qwq = _with_template(tiny, "Qwen-Qwen3-0.6B"), _with_template(tiny, "Qwen-QwQ-32B")
    assert _thinking(qwen3) == Thinking("<think>", "</think>", open=False)  # the model may open a block
    assert _thinking(qwq) == Thinking("<think>", "</think>", open=True)  # the prompt opened it
    assert _thinking(qwen3, enable_thinking=False) is None  # the template wrote an empty block: no thinking
    assert _thinking(tiny) is None  # a template without <think>
    earlier = qwen3.tokenizer.encode("</think>4<|im_end|>\n", add_special_tokens=False).ids
    assert len(earlier) <= PROMPT_TAIL_TOKENS
    assert thinking_of(qwen3, earlier) == Thinking("<think>", "</think>", open=False)  # an earlier turn's tags


def _thinker(tiny: LoadedModel) -> tuple[LoadedModel, str]:
    """A model under QwQ's template (the prompt opens the block) that writes one word forever, and the word."""
    model = stub_model(_with_template(tiny, "Qwen-QwQ-32B"), " the")
    return model, model.tokenizer.decode(model.tokenizer.encode(" the", add_special_tokens=False).ids[:1])


async def _run(model: LoadedModel, budget: int, replay: list[int] | None = None, max_tokens: int = 24):
    ids = build_prompt_ids(model, messages=QUESTION, max_tokens=max_tokens, truncate=False)
    request = GenRequest(
        "r",
        ids,
        greedy(max_tokens=max_tokens),
        generated_ids=replay or [],
        thinking=thinking_of(model, ids),
        reasoning_budget=budget,
    )
    return (await generate(model, [request]))["r"]


@pytest.mark.parametrize("budget", [0, 3])
async def test_a_spent_budget_closes_the_thinking_and_the_answer_follows(tiny: LoadedModel, budget: int) -> None:
    model, word = _thinker(tiny)
    result = await _run(model, budget)
    assert result.text.startswith(word * budget + CLOSING + word)
    assert result.completion_tokens == 24  # the answer goes on after the close


async def test_no_budget_lets_the_thinking_run(tiny: LoadedModel) -> None:
    model, word = _thinker(tiny)
    ids = build_prompt_ids(model, messages=QUESTION, max_tokens=6, truncate=False)
    request = GenRequest("r", ids, greedy(max_tokens=6), thinking=thinking_of(model, ids))
    assert (await generate(model, [request]))["r"].text == word * 6


async def test_a_takeover_in_the_middle_of_the_close_finishes_it(tiny: LoadedModel) -> None:
    model, _ = _thinker(tiny)
    whole = await _run(model, 2)
    closing = len(model.tokenizer.encode(CLOSING, add_special_tokens=False).ids)
    assert closing > 1
    cut = 2 + closing // 2  # inside the forced close
    resumed = await _run(model, 2, replay=whole.token_ids[:cut])
    assert whole.token_ids[:cut] + resumed.token_ids == whole.token_ids
