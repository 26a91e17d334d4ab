"""A `tokenizers.Tokenizer` built from GGUF vocabulary metadata (byte-level BPE, the "gpt2" tokenizer model)."""

from __future__ import annotations

import logging

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types that are special tokens

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def pre_tokenizer_for(kind: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's `tokenizer.ggml.pre` names the pre-tokenizer the original tokenizer.json used."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if kind in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind in ("llama-bpe", "llama3", "smaug-bpe"):
        return _split_then_bytes(LLAMA3_PATTERN)
    if kind == "qwen2":
        return _split_then_bytes(QWEN2_PATTERN)
    if kind not in ("gpt2", "default"):
        log.warning("unknown GGUF pre-tokenizer %r: using GPT-2 byte-level splitting", kind)
    return byte_level


def build_gguf_tokenizer(tokens: list[str], merges: list[str], token_types: list[int], pre: str) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tokenizer.pre_tokenizer = pre_tokenizer_for(pre)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, kind in enumerate(token_types) if kind in (CONTROL, USER_DEFINED)]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return tokenizer
