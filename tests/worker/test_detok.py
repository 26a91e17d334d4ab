"""Incremental detokenization (whole characters only, deltas add up) and stop strings."""

from __future__ import annotations

import codecs
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.support.tiny_model import VOCAB
from worker.detok import IncrementalDetokenizer, StopStrings, text_state
from worker.token_bytes import _gpt2_unicode_to_byte, special_ids


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def stream(tokenizer: Tokenizer, prompt: list[int], generated: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    return [detok.add(token) for token in generated] + [detok.flush()]


def test_multibyte_characters_come_out_whole(tokenizer: Tokenizer) -> None:
    text = "Unicode: Ünïcödé ✓ 日本語 🙂 and more"
    ids = [tokenizer.token_to_id(piece) for piece in _byte_pieces(tokenizer, text)]
    deltas = stream(tokenizer, [], ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
    assert any(delta == "" for delta in deltas)  # held while a character was incomplete


def _byte_pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    """One single-byte token per byte of text (the byte-level alphabet), to split every character."""
    pieces = tokenizer.encode(text).tokens
    return [char for piece in pieces for char in piece]


def test_leading_space_after_the_prompt_is_kept(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("The quick brown").ids
    generated = tokenizer.encode(" fox jumps").ids
    assert "".join(stream(tokenizer, prompt, generated)) == " fox jumps"


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=6), generated=st.lists(st.integers(0, VOCAB - 1), max_size=30)
)
def test_deltas_concatenate_to_the_full_decode(tokenizer: Tokenizer, prompt: list[int], generated: list[int]) -> None:
    deltas = stream(tokenizer, prompt, generated)
    assert "".join(deltas) == tokenizer.decode(generated, skip_special_tokens=True)


def byte_token(tokenizer: Tokenizer, value: int) -> int:
    """The byte-level token for one byte."""
    char = {byte: char for char, byte in _gpt2_unicode_to_byte().items()}[value]
    return tokenizer.token_to_id(char)


def test_invalid_bytes_come_out_at_once(tokenizer: Tokenizer) -> None:
    # A model that samples stray continuation bytes must not have its whole answer held back.
    deltas = stream(tokenizer, [], [byte_token(tokenizer, 0x80)] * 5 + [byte_token(tokenizer, ord("A"))])
    assert deltas == ["\ufffd"] * 5 + ["A", ""]


@settings(max_examples=200, deadline=None)
@given(data=st.lists(st.integers(0, 255), max_size=40))
def test_only_an_unfinished_character_is_held(tokenizer: Tokenizer, data: list[int]) -> None:
    detok = IncrementalDetokenizer(tokenizer, [])
    emitted = ""
    for end, value in enumerate(data, start=1):
        emitted += detok.add(byte_token(tokenizer, value))
        assert bytes(data[:end]).decode("utf-8", "replace").startswith(emitted)
        held = _unfinished_tail(bytes(data[:end]))
        assert emitted == bytes(data[: end - held]).decode("utf-8", "replace")
    assert emitted + detok.flush() == bytes(data).decode("utf-8", "replace")


def _unfinished_tail(data: bytes) -> int:
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data)
    return len(decoder.getstate()[0])


def feed(stops: StopStrings, pieces: list[str]) -> tuple[str, str | None]:
    emitted = ""
    for piece in pieces:
        text, stop = stops.push(piece)
        emitted += text
        if stop is not None:
            return emitted, stop
    return emitted + stops.flush(), None


def test_stop_string_split_across_pieces_is_trimmed() -> None:
    assert feed(StopStrings(["STOP"]), ["Hello S", "T", "OP and more"]) == ("Hello ", "STOP")


def test_partial_match_is_held_back_then_released() -> None:
    stops = StopStrings(["</end>"])
    assert stops.push("a </e") == ("a ", None)
    assert stops.push("xtra") == ("</extra", None)


def test_the_earliest_stop_string_wins() -> None:
    assert feed(StopStrings(["world", "lo"]), ["hello world"]) == ("hel", "lo")


def test_unfinished_partial_match_is_flushed_at_the_end() -> None:
    assert feed(StopStrings(["###"]), ["answer #", "#"]) == ("answer ##", None)


def test_without_stop_strings_text_passes_straight_through() -> None:
    assert StopStrings([]).push("anything") == ("anything", None)


@pytest.mark.parametrize(
    "text, stops",
    [
        ("Answer: 龘 ok, 日本語 🙂", []),
        ("The capital of France is Paris.", ["capital of Italy"]),
        ("The capital of France is Paris.", ["is Rome", "Par!"]),
    ],
)
def test_a_takeover_at_any_token_continues_the_text_exactly(tokenizer: Tokenizer, text: str, stops: list[str]) -> None:
    """A worker died after streaming k tokens (its text held back a partial character or stop string);
    the one that takes over replays those k tokens and emits exactly the rest of the text."""
    prompt = tokenizer.encode("Say it:").ids
    ids = [tokenizer.token_to_id(piece) for piece in _byte_pieces(tokenizer, text)]
    for k in range(1, len(ids)):
        detok, matcher = text_state(tokenizer, prompt, [], stops)
        first_run = "".join(matcher.push(detok.add(token))[0] for token in ids[:k])
        detok, matcher = text_state(tokenizer, prompt, ids[:k], stops)
        rest = "".join(matcher.push(detok.add(token))[0] for token in ids[k:])
        rest += matcher.push(detok.flush())[0] + matcher.flush()
        assert first_run + rest == text, k


def test_special_tokens_add_no_text_and_are_listed_once_per_tokenizer(tokenizer: Tokenizer) -> None:
    specials = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    assert specials
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add(token) for token in sorted(specials)] == [""] * len(specials)
    assert special_ids(tokenizer) == specials
    assert IncrementalDetokenizer(tokenizer, []).special_ids is detok.special_ids  # not listed again
