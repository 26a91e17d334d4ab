"""The progress record of a request: the token ids streamed so far, as little-endian uint32s.

A string and not a list, so that a worker writes each token at its own offset (SETRANGE): writing
the same step twice, after a lost reply, changes nothing.
"""

from __future__ import annotations

import struct

TOKEN_BYTES = struct.calcsize("<I")  # one token id: a little-endian uint32


def encode_progress(token_ids: list[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def decode_progress(raw: bytes | None) -> list[int]:
    """The token ids of a progress record (a trailing partial id, never written by lmq, is ignored)."""
    if not raw:
        return []
    count = len(raw) // TOKEN_BYTES
    return list(struct.unpack(f"<{count}I", raw[: count * TOKEN_BYTES]))
