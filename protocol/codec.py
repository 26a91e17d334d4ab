"""msgpack encoding with bounded sizes: no ext types, no pickle, no surprises."""

from __future__ import annotations

from typing import Any

import msgpack

from .errors import ProtocolError

MAX_MESSAGE_BYTES = 1 << 20  # 1 MiB: a request larger than this is refused unread


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("bad_request", f"msgpack extension type {code} is not allowed")


def encode(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decode_map(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode one msgpack map with string keys, or raise ProtocolError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("bad_request", "message must be msgpack bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("too_large", f"message is {len(data)} bytes; the limit is {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise ProtocolError("bad_request", f"not a msgpack message ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise ProtocolError("bad_request", "message must be a msgpack map with string keys")
    return obj
