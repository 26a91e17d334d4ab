"""What the batch handlers share: the store and runner of this gateway, bodies larger than a live
request's, page limits, and turning input lines into validated items."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..context import Gateway, gateway_of
from ..errors import ApiError
from ..validate import MAX_JSON_DEPTH, nests_deeper
from . import items
from .runner import BatchRunner
from .store import BatchStore

MAX_REPORTED_ERRORS = 20  # line errors named in one answer


@dataclass
class Batches:
    gateway: Gateway
    store: BatchStore
    runner: BatchRunner


BATCHES = web.AppKey("batches", Batches)


def batches_of(request: web.Request) -> Batches:
    return request.app[BATCHES]


async def read_large_body(request: web.Request, limit: int) -> bytes:
    """The whole body, up to `limit` bytes (a batch's, not the app's smaller limit for live requests)."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"the body is larger than the {limit} bytes a batch may have")
    body = bytearray()
    async for chunk in request.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the body is larger than the {limit} bytes a batch may have")
    return bytes(body)


def page_limit(request: web.Request, default: int, most: int) -> int:
    text = request.query.get("limit")
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise ApiError(400, f"limit: must be a whole number from 1 to {most}", param="limit")
    return int(text)


@dataclass
class LineError:
    line: int  # 1-based line of the input file, or index of an Anthropic request
    message: str
    param: str | None = None
    code: str = "invalid_request"


def item_or_error(gateway: Gateway, where: int, custom_id: Any, url: Any, body: Any, seen: set[str], urls: tuple[str, ...]) -> dict[str, Any] | LineError:
    """One validated item ({custom_id, url, body}) for one of `urls`, or what is wrong with it."""
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(where, "custom_id: must be a non-empty string", "custom_id")
    if custom_id in seen:
        return LineError(where, f"custom_id: {custom_id!r} is used twice; each request needs its own", "custom_id", "duplicate_custom_id")
    if url not in urls:
        return LineError(where, f"url: must be one of {', '.join(urls)}", "url")
    try:
        items.check(gateway, url, body)
    except ApiError as error:
        return LineError(where, error.message, f"body.{error.param}" if error.param else "body")
    seen.add(custom_id)
    return {"custom_id": custom_id, "url": url, "body": body}


def openai_items(gateway: Gateway, data: bytes) -> tuple[list[dict[str, Any]], list[LineError]]:
    """The items of an OpenAI batch input file (JSONL of {custom_id, method, url, body}) and every line's error."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return [], [LineError(0, "the file is not UTF-8 text")]
    found: list[dict[str, Any]] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except (ValueError, RecursionError) as exc:
            errors.append(LineError(number, f"not valid JSON: {exc}"))
            continue
        if nests_deeper(request, MAX_JSON_DEPTH):
            errors.append(LineError(number, f"nests arrays and objects more than {MAX_JSON_DEPTH} deep"))
            continue
        if not isinstance(request, dict):
            errors.append(LineError(number, "must be a JSON object {custom_id, method, url, body}"))
            continue
        if request.get("method", "POST") != "POST":
            errors.append(LineError(number, "method: must be POST", "method"))
            continue
        item = item_or_error(gateway, number, request.get("custom_id"), request.get("url"), request.get("body"), seen, items.OPENAI_ENDPOINTS)
        (errors if isinstance(item, LineError) else found).append(item)
    return found, errors


def count_limit(gateway: Gateway, found: int) -> LineError | None:
    if found == 0:
        return LineError(0, "the batch has no requests")
    most = gateway.config.batch_max_items
    return LineError(0, f"the batch has {found} requests; a batch may have at most {most}") if found > most else None


def describe(errors: list[LineError], what: str | None = "line") -> str:
    """The errors in one message: `line 3: messages: ...; line 7: ...` (`what` None: the messages alone)."""
    shown = "; ".join(f"{what} {error.line}: {error.message}" if error.line and what else error.message for error in errors[:MAX_REPORTED_ERRORS])
    more = f"; and {len(errors) - MAX_REPORTED_ERRORS} more" if len(errors) > MAX_REPORTED_ERRORS else ""
    return f"{len(errors)} invalid: {shown}{more}" if len(errors) > 1 else shown


def gateway_batches(request: web.Request) -> tuple[Gateway, Batches]:
    return gateway_of(request), batches_of(request)
