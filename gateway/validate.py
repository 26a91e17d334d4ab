"""Reading a JSON body and checking its fields; every problem is a 400 naming the field."""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web

import protocol

from .errors import ApiError

MAX_JSON_DEPTH = 64  # real bodies, schemas included, nest a dozen levels


async def read_json_object(request: web.Request) -> dict[str, Any]:
    if request.content_type != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, not {request.content_type!r}")
    body = loads_json(await request.read())  # aiohttp answers 413 beyond the app's client_max_size
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def loads_json(raw: bytes | str, what: str = "the body") -> Any:
    """Parse JSON nested at most MAX_JSON_DEPTH deep: deeper nesting (a json_schema 300 levels down)
    would exhaust Python's recursion somewhere past the parser, as a 500; it is a 400 here."""
    try:
        value = json.loads(raw)
    except RecursionError:
        value = None
        deep = True
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"{what} is not valid JSON: {exc}") from None
    else:
        deep = nests_deeper(value, MAX_JSON_DEPTH)
    if deep:
        raise ApiError(400, f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} deep")
    return value


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether `value` has arrays/objects more than `limit` levels deep (iteratively: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def invalid(param: str, problem: str) -> ApiError:
    return ApiError(400, f"{param}: {problem}", param=param)


def required_str(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise invalid(name, "is required")
    if not isinstance(value, str):
        raise invalid(name, "must be a string")
    return value


def optional_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, "must be an integer")
    if not lo <= value <= hi:
        raise invalid(name, f"must be between {lo} and {hi}")
    return value


def optional_number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(name, "must be a number")
    if not lo <= value <= hi:
        raise invalid(name, f"must be between {lo} and {hi}")
    return float(value)


def optional_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid(name, "must be true or false")
    return value


def optional_object(body: dict[str, Any], name: str) -> dict[str, Any]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(name, "must be an object")
    return value


def string_list(value: Any, name: str) -> list[str]:
    """A string or a list of strings (as `stop` accepts), as a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise invalid(name, "must be a string or a list of strings")
    return value


def text_content(value: Any, name: str) -> str:
    """Message content: a string, or a list of text parts/blocks (joined by newlines)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(name, "must be a string or a list of text parts")
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"{name}[{i}]", 'only text parts ({"type": "text", "text": ...}) are supported')
        texts.append(part["text"])
    return "\n".join(texts)


def refuse_unknown(body: dict[str, Any], known: set[str]) -> None:
    """A parameter lmq does not implement is refused by name, never silently ignored."""
    unknown = sorted(name for name in body if name not in known)
    if unknown:
        raise invalid(
            unknown[0],
            f"lmq does not support the parameter {unknown[0]!r}"
            + (f" (nor {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else ""),
        )


def sampling_params(fields: dict[str, Any], defaults: dict[str, Any] | None = None) -> protocol.SamplingParams:
    """The protocol's sampling parameters from the given (non-None) fields, checked by the protocol too.

    `defaults` (the gateway's --sampling-defaults) shape the distribution of a request that sets none of
    temperature, top_p, top_k, min_p; a request that sets any of them gets exactly what it set, the rest
    neutral (protocol.parse_sampling)."""
    given = {key: value for key, value in fields.items() if value is not None}
    if defaults and not any(name in given for name in protocol.DISTRIBUTION_FIELDS):
        given |= defaults
    try:
        return protocol.parse_sampling(given)
    except protocol.ProtocolError as exc:
        raise ApiError(400, exc.message, param=exc.message.split(":")[0].removeprefix("sampling.")) from None
