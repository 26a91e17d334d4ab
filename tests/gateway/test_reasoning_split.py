"""gateway/reasoning.py: thinking split from the answer, on outputs as real thinking models write them,
fed whole, a character at a time and in uneven pieces (a tag cut across deltas)."""

from __future__ import annotations

import pytest

from gateway.reasoning import ReasoningSplit, Thinking

# Outputs recorded from real models (greedy, llama-server --reasoning-format none), and what each
# must split into: (open: the prompt opened the block, output, reasoning, answer).
FIXTURES = {
    "qwen3-0.6b": (
        False,
        "<think>\nOkay, the user is asking what 2+2 is. That's basic arithmetic. 2 plus 2 equals 4. "
        "I should just give the answer clearly.\n</think>\n\n2 + 2 equals **4**.",
        "Okay, the user is asking what 2+2 is. That's basic arithmetic. 2 plus 2 equals 4. "
        "I should just give the answer clearly.",
        "2 + 2 equals **4**.",
    ),
    "deepseek-r1-distill-qwen-7b": (  # its template ends the prompt with "<think>\n"
        True,
        "Okay, so I need to figure out what 2 plus 2 is. Hmm, let me think. I remember from school that "
        "adding numbers means combining them.\n\nSo, 2 plus 2 is 4.\n</think>\n\n"
        "2 plus 2 equals 4.\n\n**Answer:** \\boxed{4}",
        "Okay, so I need to figure out what 2 plus 2 is. Hmm, let me think. I remember from school that "
        "adding numbers means combining them.\n\nSo, 2 plus 2 is 4.",
        "2 plus 2 equals 4.\n\n**Answer:** \\boxed{4}",
    ),
    "qwq-32b": (
        True,
        "\nOkay, the user wants the capital of France. That's Paris.\n</think>\n\nThe capital of France is **Paris**.",
        "Okay, the user wants the capital of France. That's Paris.",
        "The capital of France is **Paris**.",
    ),
    "qwen3-cut-at-max-tokens": (
        False,
        "<think>\nLet me count the letters in strawberry: s, t, r",
        "Let me count the letters in strawberry: s, t, r",
        "",
    ),
    "qwen3-no-think-block": (False, "Paris is the capital of France.", "", "Paris is the capital of France."),
    "qwen3-empty-block": (False, "<think>\n\n</think>\n\nHello! How can I help?", "", "Hello! How can I help?"),
    "a-tag-inside-the-answer": (False, "Wrap it in <think> tags.", "", "Wrap it in <think> tags."),
    "r1-cut-before-the-close": (True, "So the answer is 4.\n</thi", "So the answer is 4.\n</thi", ""),
}


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] if size else [text]


@pytest.mark.parametrize("size", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_a_recorded_output_splits_into_reasoning_and_answer_however_it_is_cut(name: str, size: int) -> None:
    opened, output, reasoning, answer = FIXTURES[name]
    split = ReasoningSplit(open=opened)
    parts = [split.feed(piece) for piece in _pieces(output, size)] + [split.finish()]
    assert "".join(part.reasoning for part in parts) == reasoning
    assert "".join(part.content for part in parts) == answer


def test_reasoning_streams_as_it_comes_and_holds_back_only_a_possible_tag() -> None:
    split = ReasoningSplit()
    assert split.feed("<thi").reasoning == "" and not split.thinking  # may still be the tag
    assert split.feed("nk>\nStep one").reasoning == "Step one" and split.thinking
    assert split.feed(" done.\n</").reasoning == " done."  # "\n</" waits: the close may follow
    closing = split.feed("think>\n\nFour")
    assert (closing.reasoning, closing.content, split.thinking) == ("", "Four", False)


def test_text_before_a_possible_tag_is_the_answer_once_it_cannot_be_one() -> None:
    split = ReasoningSplit()
    assert split.feed("  <th").content == ""
    assert split.feed("ere").content == "  <there"


def test_the_thinking_tokens_are_those_of_the_block_tags_included() -> None:
    thinking = Thinking()
    thinking.started({"reasoning": {"start": "<think>", "end": "</think>", "open": False}})
    for text in ["\n", "<thi", "nk>", "Hm.", "</think>", "\n\nFour", "."]:
        thinking.feed(text, 1)
    assert (thinking.tokens, thinking.text) == (5, "Hm.")
    plain = Thinking()  # the worker said nothing: the answer does not think
    assert plain.feed("<think>x</think>y", 3).content == "<think>x</think>y" and plain.tokens == 0
