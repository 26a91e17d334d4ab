"""Batch input read into items: the format checked up front, off the event loop, with bounded memory.

What is checked here is the input's format, as OpenAI checks a batch file up front: each OpenAI
line is a JSON object with a non-empty, unique `custom_id`, `method` POST, a `url` the batch may
call and a `body` object naming a `model`; each Anthropic request has a `custom_id` of 1-64
letters, digits, `_` or `-` (unique) and `params` naming a `model`. What a body asks for is
checked when its item runs (runner.py builds its protocol request with the live endpoint's own
checks): a body the endpoint would refuse ends that item `errored`, with the endpoint's status and
error (OpenAI's error file, Anthropic's results), and the other items run. So one bad request
never refuses 9,999 good ones.

Why off the loop and how bounded: a batch input may be `batch_max_bytes` (64 MiB), and parsing it
on the gateway's event loop froze every stream of that gateway for seconds. The parse runs in a
thread (`asyncio.to_thread`) as one json call per line or request, so the loop takes the GIL back
between calls; a line longer than a live request's body (`max_body_bytes`) is refused before it
is parsed, so no single call runs long. Limits come before work: the request count is checked as
lines are counted (parsing stops past `batch_max_items`), at most `MAX_REPORTED_ERRORS` errors are
kept (parsing stops once they are), lines are cut one at a time from the input (no list of every
line), and an OpenAI item is kept as its own line's text, not re-encoded. One call is not
bounded: a single Anthropic request of many MiB is parsed by one json call, which the loop waits
for (the body as a whole is bounded by `batch_max_bytes`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..context import Gateway
from ..validate import MAX_JSON_DEPTH, nests_deeper
from . import items
from .service import MAX_REPORTED_ERRORS, LineError

CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # Anthropic's rule for a request's custom_id
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


@dataclass
class Parsed:
    """The items of a batch input, or what is wrong with its format."""

    items: list[str] = field(default_factory=list)  # each item's JSON ({custom_id, url, body, ...}), in input order
    models: set[str] = field(default_factory=set)
    errors: list[LineError] = field(default_factory=list)  # the first MAX_REPORTED_ERRORS
    more_errors: bool = False  # parsing stopped at the cap: there may be more

    def add_error(self, error: LineError) -> bool:
        """Keep the error; False once the cap is reached (the caller stops)."""
        self.errors.append(error)
        self.more_errors = len(self.errors) >= MAX_REPORTED_ERRORS
        return not self.more_errors


class _Limits:
    def __init__(self, gateway: Gateway):
        self.max_items = gateway.config.batch_max_items
        self.max_request_bytes = gateway.config.max_body_bytes


async def openai_file(
    gateway: Gateway, data: bytes | bytearray, urls: tuple[str, ...] = items.OPENAI_ENDPOINTS
) -> Parsed:
    """The items of an OpenAI batch input (JSONL of {custom_id, method, url, body}), parsed in a thread.
    A line whose url is a valid endpoint but not one of `urls` is an `invalid_url` error."""
    return await asyncio.to_thread(_openai_file, _Limits(gateway), data, urls)


async def anthropic_body(gateway: Gateway, raw: bytes | bytearray) -> Parsed:
    """The items of an Anthropic batch body ({requests: [{custom_id, params}]}), parsed in a thread.
    Raises ValueError when the body is not JSON of that shape."""
    return await asyncio.to_thread(_anthropic_body, _Limits(gateway), raw)


# ---------------------------------------------------------------- OpenAI: JSONL, a line at a time


def _lines(data: bytes | bytearray) -> Iterator[tuple[int, bytes | bytearray]]:
    """(1-based number, line) of each line, cut one at a time."""
    start, number, size = 0, 0, len(data)
    while start < size:
        end = data.find(b"\n", start)
        end = size if end < 0 else end
        number += 1
        yield number, data[start:end]
        start = end + 1


def _openai_file(limits: _Limits, data: bytes | bytearray, urls: tuple[str, ...]) -> Parsed:
    parsed, seen, count = Parsed(), set(), 0
    for number, line in _lines(data):
        if not line.strip():
            continue
        count += 1
        if count > limits.max_items:
            parsed.errors = [
                LineError(
                    0,
                    f"the batch has more than {limits.max_items} requests; a batch may have at most {limits.max_items}",
                )
            ]
            parsed.more_errors = False
            return parsed
        problem = _openai_line(limits, number, line, seen, urls, parsed)
        if problem is not None and not parsed.add_error(problem):
            return parsed
    if count == 0:
        parsed.errors.append(LineError(0, "the batch has no requests"))
    return parsed


def _openai_line(
    limits: _Limits, number: int, line: bytes | bytearray, seen: set[str], urls: tuple[str, ...], parsed: Parsed
) -> LineError | None:
    if len(line) > limits.max_request_bytes:
        return LineError(
            number,
            f"the request is larger than the {limits.max_request_bytes} bytes a request may have",
            code="request_too_large",
        )
    try:
        text = line.decode("utf-8")
        request = json.loads(text)
    except UnicodeDecodeError:
        return LineError(number, "not UTF-8 text")
    except (ValueError, RecursionError) as exc:
        return LineError(number, f"not valid JSON: {exc}")
    if nests_deeper(request, MAX_JSON_DEPTH):
        return LineError(number, f"nests arrays and objects more than {MAX_JSON_DEPTH} deep")
    if not isinstance(request, dict):
        return LineError(number, "must be a JSON object {custom_id, method, url, body}")
    if request.get("method", "POST") != "POST":
        return LineError(number, "method: must be POST", "method")
    url = request.get("url")
    problem = _item_format(number, request.get("custom_id"), url, request.get("body"), seen, items.OPENAI_ENDPOINTS)
    if problem is not None:
        return problem
    parsed.models.add(request["body"]["model"])
    if url not in urls:
        return LineError(number, f"url: {url} in a batch for {' or '.join(urls)}", "url", "invalid_url")
    parsed.items.append(text.strip())
    return None


def _item_format(
    where: int, custom_id: Any, url: Any, body: Any, seen: set[str], urls: tuple[str, ...]
) -> LineError | None:
    """What is wrong with one item's format (custom_id, url, a body naming a model), or None (its custom_id taken)."""
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(where, "custom_id: must be a non-empty string", "custom_id")
    if custom_id in seen:
        return LineError(
            where,
            f"custom_id: {custom_id!r} is used twice; each request needs its own",
            "custom_id",
            "duplicate_custom_id",
        )
    if url not in urls:
        return LineError(where, f"url: must be one of {', '.join(urls)}", "url")
    if not isinstance(body, dict):
        return LineError(where, "body: must be a JSON object", "body")
    if not isinstance(body.get("model"), str) or not body["model"]:
        return LineError(where, "model: is required and must be a string", "body.model")
    seen.add(custom_id)
    return None


# ---------------------------------------------------------------- Anthropic: one JSON body, a request at a time


def _anthropic_body(limits: _Limits, raw: bytes | bytearray) -> Parsed:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the body is not UTF-8 text") from None
    parsed, seen, count = Parsed(), set(), 0
    try:
        for i, entry in _requests(text):
            count += 1
            if count > limits.max_items:
                return Parsed(
                    errors=[
                        LineError(
                            0,
                            f"the batch has more than {limits.max_items} requests; a batch may have at most {limits.max_items}",
                        )
                    ]
                )
            problem = _anthropic_request(i, entry, seen, parsed)
            if problem is not None and not parsed.add_error(problem):
                return parsed
    except RecursionError:
        raise ValueError(f"it nests arrays and objects more than {MAX_JSON_DEPTH} deep") from None
    if count == 0:
        parsed.errors.append(LineError(0, "the batch has no requests"))
    return parsed


def _anthropic_request(i: int, entry: Any, seen: set[str], parsed: Parsed) -> LineError | None:
    entry = entry if isinstance(entry, dict) else {}
    custom_id = entry.get("custom_id")
    if isinstance(custom_id, str) and not CUSTOM_ID.fullmatch(custom_id):
        return LineError(i, "custom_id: 1-64 letters, digits, '_' or '-'", "custom_id")
    params = entry.get("params")
    if nests_deeper(params, MAX_JSON_DEPTH):
        return LineError(i, f"params: nests arrays and objects more than {MAX_JSON_DEPTH} deep", "params")
    problem = _item_format(i, custom_id, items.MESSAGES, params, seen, (items.MESSAGES,))
    if problem is not None:
        return problem
    parsed.items.append(
        json.dumps({"custom_id": custom_id, "url": items.MESSAGES, "body": params}, separators=(",", ":"))
    )
    parsed.models.add(params["model"])
    return None


def _requests(text: str) -> Iterator[tuple[int, Any]]:
    """(index, value) of each element of the top-level object's `requests` list, one json call each;
    other members are parsed and dropped. ValueError when the text is not such an object."""
    at = _skip(text, _expect(text, _skip(text, 0), "{"))
    found = False
    if text.startswith("}", at):
        at += 1
    else:
        while True:
            name, at = _DECODER.raw_decode(text, at)
            if not isinstance(name, str):
                raise ValueError("an object's member name must be a string")
            at = _expect(text, _skip(text, at), ":")
            if name == "requests":
                if found:
                    raise ValueError("requests: given twice")
                found = True
                at = yield from _elements(text, _skip(text, at))
            else:
                _, at = _DECODER.raw_decode(text, _skip(text, at))
            at = _skip(text, at)
            if text.startswith("}", at):
                at += 1
                break
            at = _skip(text, _expect(text, at, ","))
    if _skip(text, at) != len(text):
        raise ValueError("extra data after the body")
    if not found:
        raise ValueError("requests: must be a list of {custom_id, params}")


def _elements(text: str, at: int):
    if not text.startswith("[", at):
        raise ValueError("requests: must be a list of {custom_id, params}")
    at = _skip(text, at + 1)
    if text.startswith("]", at):
        return at + 1
    index = 0
    while True:
        value, at = _DECODER.raw_decode(text, at)
        yield index, value
        index += 1
        at = _skip(text, at)
        if text.startswith("]", at):
            return at + 1
        at = _skip(text, _expect(text, at, ","))


def _skip(text: str, at: int) -> int:
    return _WHITESPACE.match(text, at).end()  # type: ignore[union-attr]


def _expect(text: str, at: int, char: str) -> int:
    if not text.startswith(char, at):
        raise ValueError(f"expected {char!r} at character {at}")
    return at + 1
