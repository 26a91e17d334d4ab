"""A `tokenizers.Tokenizer` built from GGUF vocabulary metadata.

Two vocabulary kinds (tokenizer.ggml.model):
- "gpt2": byte-level BPE with merges; `tokenizer.ggml.pre` names the pre-tokenizer of the original
  tokenizer.json (Qwen2's digit-at-a-time regex, Llama 3's, SmolLM's …). Unknown names are refused:
  a wrong split would silently change every prompt's ids.
- "llama": SentencePiece BPE (Llama 2, Mistral, Gemma, Phi-3): pieces with scores, "▁" for spaces,
  <0xNN> byte pieces for what the vocabulary lacks. Built as HF's converter builds it: BPE whose
  merges are the pairs forming each normal piece, ranked by that piece's score, with byte fallback.
  As in llama.cpp, each stretch of text between special tokens gets the dummy-prefix space when
  `add_space_prefix` (Llama, Mistral; Gemma has none).

Control tokens become special added tokens; user-defined ones added tokens that are not special
(they stay in decoded text, as in HF). add_bos/add_eos become the post-processor, so
`encode(text, add_special_tokens=True)` adds them as the model expects.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp token types
SPACE = "\u2581"  # "▁", SentencePiece's visible space

LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class UnsupportedTokenizer(ValueError):
    """The GGUF's tokenizer model or pre-tokenizer is one lmq cannot rebuild exactly."""


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _gpt2() -> tuple[None, pre_tokenizers.PreTokenizer]:
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False)


def _digits() -> tuple[None, pre_tokenizers.PreTokenizer]:
    return None, pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


def _llama3() -> tuple[None, pre_tokenizers.PreTokenizer]:
    return None, _split_then_bytes(LLAMA3_PATTERN)


def _qwen2() -> tuple[normalizers.Normalizer, pre_tokenizers.PreTokenizer]:
    return normalizers.NFC(), _split_then_bytes(QWEN2_PATTERN)  # Qwen2's tokenizer.json normalises to NFC


# tokenizer.ggml.pre -> (normalizer, pre-tokenizer) as the original tokenizer.json has them
BPE_PRE_TOKENIZERS = {
    "gpt2": _gpt2,
    "gpt-2": _gpt2,
    "default": _gpt2,
    "smollm": _digits,
    "starcoder": _digits,
    "refact": _digits,
    "llama-bpe": _llama3,
    "llama3": _llama3,
    "smaug-bpe": _llama3,
    "qwen2": _qwen2,
    "deepseek-r1-qwen": _qwen2,
}


def _added_tokens(tokens: list[str], token_types: list[int]) -> list[AddedToken]:
    added = []
    for token, kind in zip(tokens, token_types):
        if kind in (CONTROL, UNKNOWN):
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    return added


def _post_processor(
    tokens: list[str], bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool
) -> processors.PostProcessor | None:
    before = [tokens[bos_id]] if add_bos and bos_id is not None else []
    after = [tokens[eos_id]] if add_eos and eos_id is not None else []
    if not before and not after:
        return None
    specials = [(tokens[i], i) for i in {bos_id if before else None, eos_id if after else None} if i is not None]
    single = " ".join([*before, "$A", *after])
    pair = " ".join([*before, "$A", *after, *before, "$B:1", *after])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def build_bpe_tokenizer(tokens: list[str], merges: list[str], token_types: list[int], pre: str) -> Tokenizer:
    if pre not in BPE_PRE_TOKENIZERS:
        raise UnsupportedTokenizer(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))})"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    normalizer, pre_tokenizer = BPE_PRE_TOKENIZERS[pre]()
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(_added_tokens(tokens, token_types))
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """The pairs that form each normal piece, best-scored piece first (SentencePiece merges by piece score)."""
    normal = {
        token: (score, index)
        for index, (token, score, kind) in enumerate(zip(tokens, scores, token_types))
        if kind == NORMAL
    }
    ranked = []
    for token, (score, index) in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-score, index, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def build_sentencepiece_tokenizer(
    tokens: list[str], scores: list[float], token_types: list[int], add_space_prefix: bool
) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    unknown = next((tokens[i] for i, kind in enumerate(token_types) if kind == UNKNOWN), None)
    model = models.BPE(
        vocab=vocab,
        merges=sentencepiece_merges(tokens, scores, token_types),
        unk_token=unknown,
        fuse_unk=True,
        byte_fallback=BYTE in token_types,
    )
    tokenizer = Tokenizer(model)
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*decode, decoders.Strip(" ", 1, 0)] if add_space_prefix else decode)
    tokenizer.add_tokens(_added_tokens(tokens, token_types))
    return tokenizer


def build_gguf_tokenizer(get: Any) -> Tokenizer:
    """get(key, default) reads GGUF metadata (Metadata.get)."""
    kind = get("tokenizer.ggml.model")
    tokens = get("tokenizer.ggml.tokens")
    token_types = get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = build_bpe_tokenizer(
            tokens, get("tokenizer.ggml.merges", []), token_types, get("tokenizer.ggml.pre", "gpt2")
        )
        add_bos_default = False
    elif kind == "llama":
        scores = get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        tokenizer = build_sentencepiece_tokenizer(
            tokens, scores, token_types, bool(get("tokenizer.ggml.add_space_prefix", True))
        )
        add_bos_default = True
    else:
        raise UnsupportedTokenizer(
            f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2 (byte-level BPE), llama (SentencePiece))"
        )
    post = _post_processor(
        tokens,
        get("tokenizer.ggml.bos_token_id"),
        get("tokenizer.ggml.eos_token_id"),
        bool(get("tokenizer.ggml.add_bos_token", add_bos_default)),
        bool(get("tokenizer.ggml.add_eos_token", False)),
    )
    if post is not None:
        tokenizer.post_processor = post
    return tokenizer
