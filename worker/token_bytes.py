"""The raw bytes of every token of a `tokenizers.Tokenizer`, cached per tokenizer.

A token's text alone is not enough: a byte-level BPE token may hold half of a UTF-8 character, so
decoding it by itself gives U+FFFD. The grammar engine needs the exact bytes to know which tokens
can continue a JSON string, and logprobs report them (`bytes`). Three vocabularies are read:

- byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen): each character of a token stands for one byte
  through the GPT-2 byte map (`Ġ` is a space, `Ċ` a newline);
- SentencePiece style (Llama 2, Mistral, Gemma): `▁` is a space and `<0x0A>` a byte-fallback token;
- anything else: the token decoded by itself (exact for whole-character vocabularies).

Added and special tokens are their literal text (`<|im_end|>`). Ids the tokenizer does not know
(holes in the vocabulary) have no bytes.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from functools import cache

from tokenizers import Tokenizer

__all__ = ["special_ids", "token_bytes", "token_text"]

CACHED_TOKENIZERS = 8  # a worker serves one model; tests make a few
BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPIECE_SPACE = "\u2581"  # ▁

_cache: OrderedDict[int, tuple[Tokenizer, list[bytes], frozenset[int]]] = OrderedDict()
_lock = threading.Lock()


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Each token's bytes, index = token id (shared, do not modify)."""
    return _vocabulary(tokenizer)[0]


def special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of the added tokens marked special. Read once per tokenizer: listing the added tokens
    builds one object each (Gemma 3 has 6,414: ~2 ms, on the loop for every request it started)."""
    return _vocabulary(tokenizer)[1]


def _vocabulary(tokenizer: Tokenizer) -> tuple[list[bytes], frozenset[int]]:
    key = id(tokenizer)
    with _lock:
        hit = _cache.get(key)
        if hit is not None and hit[0] is tokenizer:
            _cache.move_to_end(key)
            return hit[1], hit[2]
    added = tokenizer.get_added_tokens_decoder()
    table = _read_vocabulary(tokenizer, {token_id: token.content for token_id, token in added.items()})
    specials = frozenset(token_id for token_id, token in added.items() if token.special)
    with _lock:
        _cache[key] = (tokenizer, table, specials)  # holding the tokenizer keeps its id from being reused
        while len(_cache) > CACHED_TOKENIZERS:
            _cache.popitem(last=False)
    return table, specials


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's text as UTF-8, an incomplete character shown as U+FFFD ('' for unknown ids)."""
    table = token_bytes(tokenizer)
    if 0 <= token_id < len(table):
        return table[token_id].decode("utf-8", errors="replace")
    return ""


def _read_vocabulary(tokenizer: Tokenizer, added: dict[int, str]) -> list[bytes]:
    """Each token's bytes; `added`: the added tokens' ids and texts."""
    pieces = _piece_reader(tokenizer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    size = max(size, max(added, default=-1) + 1)
    table: list[bytes] = []
    for token_id in range(size):
        if token_id in added:
            table.append(added[token_id].encode("utf-8"))
            continue
        piece = tokenizer.id_to_token(token_id)
        table.append(b"" if piece is None else pieces(tokenizer, token_id, piece))
    return table


def _piece_reader(tokenizer: Tokenizer):
    """How a vocabulary entry turns into bytes, chosen from the tokenizer's decoder (read alone: the whole
    tokenizer's JSON is its vocabulary too, ~1 s to write and parse for Gemma 3's 262,144 entries)."""
    decoder = tokenizer.decoder
    decoders = set() if decoder is None else _decoder_types(json.loads(decoder.__getstate__()))
    if "ByteLevel" in decoders:
        return _byte_level_piece
    if "Metaspace" in decoders or "ByteFallback" in decoders or getattr(tokenizer.model, "byte_fallback", False):
        return _sentencepiece_piece
    return _decoded_piece


def _decoder_types(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    types = {decoder.get("type", "")}
    for inner in decoder.get("decoders") or []:
        types |= _decoder_types(inner)
    return types


def _byte_level_piece(tokenizer: Tokenizer, token_id: int, piece: str) -> bytes:
    byte_of = _gpt2_unicode_to_byte()
    if all(char in byte_of for char in piece):
        return bytes(byte_of[char] for char in piece)
    return piece.encode("utf-8")  # an entry written as plain text


def _sentencepiece_piece(tokenizer: Tokenizer, token_id: int, piece: str) -> bytes:
    fallback = BYTE_FALLBACK_TOKEN.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    return piece.replace(SPIECE_SPACE, " ").encode("utf-8")


def _decoded_piece(tokenizer: Tokenizer, token_id: int, piece: str) -> bytes:
    return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


@cache
def _gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 byte values, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return {char: byte for byte, char in mapping.items()}
