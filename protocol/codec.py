"""msgpack encoding with bounded sizes: no ext types, no pickle, no surprises."""

from __future__ import annotations

import io
from typing import Any

import msgpack

from .errors import ProtocolError

MAX_MESSAGE_BYTES = 1 << 20  # 1 MiB: a request larger than this is refused
MAX_SALVAGED_CHARS = 1024  # a refused message's `id` and `reply` are read only when this small


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("bad_request", f"msgpack extension type {code} is not allowed")


def encode(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decode_map(data: bytes | bytearray | memoryview, limit: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Decode one msgpack map with string keys, or raise ProtocolError; one over `limit` bytes is refused unread."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("bad_request", "message must be msgpack bytes")
    if len(data) > limit:
        raise ProtocolError("too_large", f"message is {len(data)} bytes; the limit is {limit}")
    return _unpack_map(data)


def salvage_fields(data: bytes | bytearray | memoryview, names: tuple[str, ...]) -> dict[str, Any]:
    """The top-level fields `names` of a message refused for its size (to find where to send the
    refusal), read without building anything else: the other values are skipped in place, and a
    salvaged value longer than MAX_SALVAGED_CHARS is not read. Whatever cannot be read is left out.
    An oversize entry therefore costs no more memory than its own bytes, whatever it holds."""
    small = MAX_SALVAGED_CHARS
    unpacker = msgpack.Unpacker(
        io.BytesIO(data),
        raw=False,
        strict_map_key=False,
        ext_hook=_refuse_ext,
        max_str_len=small,
        max_bin_len=small,
        max_array_len=small,
        max_map_len=small,
    )
    found: dict[str, Any] = {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in names and key not in found:
                found[key] = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:  # not a map, truncated, a key or salvaged value over the limits: keep what was read
        pass
    return found


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
