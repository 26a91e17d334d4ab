"""Tokenizers rebuilt from GGUF vocabularies give the original tokenizer's ids on multilingual text.

SentencePiece (tokenizer.ggml.model = llama: Llama 2, Mistral, Gemma, Phi-3): a real SentencePiece
BPE model is trained here (byte fallback, digits split, identity normalisation, as those models
are), its vocabulary written the way convert_hf_to_gguf.py writes it, and lmq's ids compared with
SentencePieceProcessor.encode. Between special tokens each stretch of text is encoded on its own,
as llama.cpp and HF's legacy Llama tokenizer do (the dummy-prefix space starts every stretch).

Byte-level BPE (tokenizer.ggml.model = gpt2): a tokenizer.json shaped like each family's (Qwen2's
NFC + digit-at-a-time regex, Llama 3's regex, SmolLM's digit splitting, GPT-2's) is trained with
the `tokenizers` library; its vocabulary and merges go into GGUF metadata with the family's
`tokenizer.ggml.pre`, and lmq's ids must equal that tokenizer.json's own.
"""

from __future__ import annotations

import io
import json
import re

import pytest
import sentencepiece
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from worker.model.gguf_tokenizer import (
    BYTE,
    CONTROL,
    LLAMA3_PATTERN,
    NORMAL,
    QWEN2_PATTERN,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    UnsupportedTokenizer,
    build_gguf_tokenizer,
)

CORPUS = """The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital.
Café déjà vu, naïve façade, über Straße, señor, Ångström, crème brûlée.
日本語のテキストと中文文本，还有한국어 문장도 있습니다。
Emoji: 🙂🚀👍🏽 and symbols ✓ → ∑ ≠ ∞.
Numbers: 0 1 2 3 42 12345 3.14159 and code: def f(x): return x ** 2
Whitespace:  two  spaces,   three,\ttabs\t\tand\nnewlines\n\n  indented lines.
The user asks, the assistant answers, and the system sets the rules.
"""
SAMPLES = [
    "Hello world! The capital of France is Paris.",
    "Crème brûlée à la française — naïve Ångström über Straße.",
    "日本語と中文，한국어도。",
    "Emoji 🙂🚀👍🏽 and ✓ → ∑, plus an unseen one: 🦙 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
    "  leading spaces, double  spaces,    four,\ttab\t\ttabs\nnew\n\nlines   ",
    "Numbers 1234567890 and 3.14159 and x**2, x$Hello HE'S",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|im_start|> spaced <tool> call",
]
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def _segments(text: str, specials: list[str]) -> list[tuple[bool, str]]:
    pattern = "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    return [(part in specials, part) for part in re.split(pattern, text) if part]


# --- SentencePiece --------------------------------------------------------------------------------


def _train_sentencepiece(add_dummy_prefix: bool) -> sentencepiece.SentencePieceProcessor:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 20),
        model_writer=model,
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        add_dummy_prefix=add_dummy_prefix,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=0.98,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        control_symbols=SPECIALS,
        user_defined_symbols=["<tool>"],
        minloglevel=2,
    )
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


def _sentencepiece_metadata(sp: sentencepiece.SentencePieceProcessor, add_space_prefix: bool) -> dict:
    """convert_hf_to_gguf.py's _create_vocab_sentencepiece, with tokenizer_config marking <tool> as a
    non-special added token (USER_DEFINED) and the chat tokens as special (CONTROL)."""
    tokens, scores, types = [], [], []
    for index in range(sp.vocab_size()):
        kind = NORMAL
        if sp.IsUnknown(index):
            kind = UNKNOWN
        elif sp.IsControl(index):
            kind = CONTROL
        elif sp.IsUnused(index):
            kind = UNUSED
        elif sp.IsByte(index):
            kind = BYTE
        tokens.append(sp.IdToPiece(index))
        scores.append(sp.GetScore(index))
        types.append(kind)
    tool = tokens.index("<tool>")
    types[tool], scores[tool] = USER_DEFINED, -1000.0
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def _getter(metadata: dict):
    return lambda key, default=None: metadata.get(key, default)


@pytest.fixture(scope="module", params=[True, False], ids=["llama-style", "gemma-style"])
def sentencepiece_pair(request: pytest.FixtureRequest) -> tuple[sentencepiece.SentencePieceProcessor, Tokenizer]:
    sp = _train_sentencepiece(add_dummy_prefix=request.param)
    return sp, build_gguf_tokenizer(_getter(_sentencepiece_metadata(sp, add_space_prefix=request.param)))


@pytest.mark.parametrize("text", [s for s in SAMPLES if "<" not in s])
def test_sentencepiece_vocab_encodes_like_sentencepiece(sentencepiece_pair, text: str) -> None:
    sp, tokenizer = sentencepiece_pair
    assert tokenizer.encode(text, add_special_tokens=False).ids == sp.encode(text)


@pytest.mark.parametrize("text", [s for s in SAMPLES if "<" in s])
def test_special_tokens_in_text_split_it_like_llama_cpp(sentencepiece_pair, text: str) -> None:
    sp, tokenizer = sentencepiece_pair
    expected = []
    for is_special, part in _segments(text, [*SPECIALS, "<tool>"]):
        expected.extend([sp.piece_to_id(part)] if is_special else sp.encode(part))
    assert tokenizer.encode(text, add_special_tokens=False).ids == expected


def test_sentencepiece_adds_bos_and_decodes_back(sentencepiece_pair) -> None:
    sp, tokenizer = sentencepiece_pair
    text = SAMPLES[1] + " " + SAMPLES[3]
    ids = tokenizer.encode(text).ids
    assert ids[0] == sp.bos_id() and ids[1:] == sp.encode(text)
    assert tokenizer.decode(ids[1:]) == sp.decode(ids[1:]) == text
    chat = tokenizer.encode("a<|im_end|>b", add_special_tokens=False).ids
    assert "<|im_end|>" in tokenizer.decode(chat, skip_special_tokens=False) and "<|im_end|>" not in tokenizer.decode(
        chat, skip_special_tokens=True
    )


# --- byte-level BPE -------------------------------------------------------------------------------


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre -> (normalizer, pre-tokenizer) of the family's tokenizer.json
FAMILY_TOKENIZERS = {
    "qwen2": lambda: (normalizers.NFC(), _split(QWEN2_PATTERN)),
    "llama-bpe": lambda: (None, _split(LLAMA3_PATTERN)),
    "smollm": lambda: (
        None,
        pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        ),
    ),
    "gpt2": lambda: (None, pre_tokenizers.ByteLevel(add_prefix_space=False)),
}


def _train_bpe(pre: str) -> Tokenizer:
    normalizer, pre_tokenizer = FAMILY_TOKENIZERS[pre]()
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines() * 10, trainer)
    tokenizer.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    return tokenizer


def _bpe_metadata(tokenizer: Tokenizer, pre: str) -> dict:
    """convert_hf_to_gguf.py's get_vocab_base: tokens by id, added special tokens CONTROL, other added ones USER_DEFINED."""
    model = json.loads(tokenizer.to_str())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    added = {entry["content"]: entry["special"] for entry in model["added_tokens"]}
    types = [(CONTROL if added[t] else USER_DEFINED) if t in added else NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": vocab["<|im_start|>"],
        "tokenizer.ggml.add_bos_token": False,
    }


@pytest.mark.parametrize("pre", sorted(FAMILY_TOKENIZERS))
def test_byte_level_bpe_vocab_encodes_like_its_tokenizer_json(pre: str) -> None:
    original = _train_bpe(pre)
    rebuilt = build_gguf_tokenizer(_getter(_bpe_metadata(original, pre)))
    for text in SAMPLES:
        ids = rebuilt.encode(text, add_special_tokens=False).ids
        assert ids == original.encode(text, add_special_tokens=False).ids, text
        assert rebuilt.decode(ids, skip_special_tokens=False) == original.decode(ids, skip_special_tokens=False)
    assert rebuilt.decode(rebuilt.encode("a<|im_end|><tool>b").ids, skip_special_tokens=True) == "a<tool>b"


def test_the_pre_tokenizers_differ_where_the_families_do() -> None:
    """The test above would pass with one pre-tokenizer for all if they split alike; they do not."""
    text = "Numbers 1234567890, x$Hello HE'S  World"
    splits = {pre: [piece for piece, _ in make()[1].pre_tokenize_str(text)] for pre, make in FAMILY_TOKENIZERS.items()}
    assert len({tuple(s) for s in splits.values()}) == len(splits)


def test_add_bos_token_becomes_the_post_processor() -> None:
    metadata = _bpe_metadata(_train_bpe("llama-bpe"), "llama-bpe") | {"tokenizer.ggml.add_bos_token": True}
    tokenizer = build_gguf_tokenizer(_getter(metadata))
    assert tokenizer.encode("Hi").ids[0] == metadata["tokenizer.ggml.bos_token_id"]
    assert tokenizer.encode("Hi", add_special_tokens=False).ids[0] != metadata["tokenizer.ggml.bos_token_id"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tokenizer.ggml.pre": "some-new-regex"}, "pre-tokenizer 'some-new-regex' is not supported"),
        ({"tokenizer.ggml.model": "bert"}, "tokenizer model 'bert' is not supported"),
    ],
)
def test_tokenizers_lmq_cannot_rebuild_are_refused(changes: dict, message: str) -> None:
    metadata = _bpe_metadata(_train_bpe("gpt2"), "gpt2") | changes
    with pytest.raises(UnsupportedTokenizer, match=re.escape(message)):
        build_gguf_tokenizer(_getter(metadata))
