"""msgpack encoding with bounded sizes: no ext types, no pickle, no surprises."""

from __future__ import annotations

from typing import Any

import msgpack

from .errors import ProtocolError

MAX_MESSAGE_BYTES = 1 << 20  # 1 MiB: a request larger than this is refused
MAX_SALVAGE_BYTES = 64 << 20  # up to this size a refused message is still read for its reply address


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
    return _unpack_map(data)


def salvage_map(data: bytes | bytearray | memoryview) -> dict[str, Any] | None:
    """The map of a message refused for its size, to find out where to send the refusal; None if unreadable."""
    if len(data) > MAX_SALVAGE_BYTES:
        return None
    try:
        return _unpack_map(data)
    except ProtocolError:
        return None


def _unpack_map(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        # Inner maps may have integer keys (a producer's `logit_bias` written as {50: 1.0}); the
        # fields that read them say what they accept.
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_refuse_ext)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise ProtocolError("bad_request", f"not a msgpack message ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise ProtocolError("bad_request", "message must be a msgpack map with string keys")
    return obj
