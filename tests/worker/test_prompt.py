"""Prompt building: chat template, raw prompts and ids, the too-long error and left truncation."""

from __future__ import annotations

import pytest

from worker.model.loader import LoadedModel
from worker.prompt import PromptTooLong, build_prompt_ids

CONTEXT = 256  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def model(tiny: LoadedModel) -> LoadedModel:
    return tiny


def decode(model: LoadedModel, ids: list[int]) -> str:
    return model.tokenizer.decode(ids, skip_special_tokens=False)


def conversation(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are terse."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what is the capital of France? " * 3})
        messages.append({"role": "assistant", "content": f"Answer {turn}: Paris is the capital."})
    messages.append({"role": "user", "content": "And the last question?"})
    return messages


def test_chat_messages_are_rendered_with_special_tokens(model: LoadedModel) -> None:
    ids = build_prompt_ids(
        model, messages=[{"role": "user", "content": "Hello, world!"}], max_tokens=10, truncate=False
    )
    assert decode(model, ids) == "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == model.tokenizer.token_to_id("<|im_start|>")


def test_raw_prompt_and_ids(model: LoadedModel) -> None:
    ids = build_prompt_ids(model, prompt="The quick brown fox", max_tokens=10, truncate=False)
    assert decode(model, ids) == "The quick brown fox"
    assert build_prompt_ids(model, prompt_ids=ids, max_tokens=10, truncate=False) == ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        build_prompt_ids(model, prompt_ids=[1, 10_000], max_tokens=10, truncate=False)


def test_too_long_prompt_is_a_clear_error(model: LoadedModel) -> None:
    with pytest.raises(PromptTooLong) as error:
        build_prompt_ids(model, prompt_ids=[5] * 250, max_tokens=10, truncate=False)
    assert "250 tokens" in str(error.value) and "max_tokens is 10" in str(error.value) and "256" in str(error.value)
    with pytest.raises(PromptTooLong, match="no room"):
        build_prompt_ids(model, prompt_ids=[5], max_tokens=CONTEXT, truncate=True)


def test_truncated_ids_keep_the_most_recent_tokens(model: LoadedModel) -> None:
    ids = list(range(3, 303))
    assert build_prompt_ids(model, prompt_ids=ids, max_tokens=56, truncate=True) == ids[-200:]


def test_truncation_drops_the_oldest_turns_and_keeps_the_system_message(model: LoadedModel) -> None:
    messages = conversation(turns=8)
    with pytest.raises(PromptTooLong):
        build_prompt_ids(model, messages=messages, max_tokens=100, truncate=False)
    ids = build_prompt_ids(model, messages=messages, max_tokens=100, truncate=True)
    assert len(ids) <= CONTEXT - 100
    text = decode(model, ids)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert text.endswith("<|im_start|>user\nAnd the last question?<|im_end|>\n<|im_start|>assistant\n")
    assert "Answer 7" in text and "Question 0" not in text


def test_truncation_cuts_an_overlong_last_message_from_its_start(model: LoadedModel) -> None:
    messages = [{"role": "system", "content": "Rules."}, {"role": "user", "content": "word " * 400 + "THE END"}]
    ids = build_prompt_ids(model, messages=messages, max_tokens=50, truncate=True)
    assert len(ids) <= CONTEXT - 50
    text = decode(model, ids)
    assert text.startswith("<|im_start|>system\nRules.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("THE END<|im_end|>\n<|im_start|>assistant\n")
