"""What the batch handlers share: the store and runner of this gateway, who the requester is (the
owner of what it creates and the only one who finds it), bodies larger than a live request's,
page limits, and the errors of an input's lines."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from ..auth import owner_of
from ..context import Gateway, gateway_of
from ..errors import ApiError
from ..leased_drivers import LeasedDrivers
from .store import BatchStore

MAX_REPORTED_ERRORS = 20  # line errors named in one answer


@dataclass
class Batches:
    gateway: Gateway
    store: BatchStore
    runner: LeasedDrivers  # runner.py's


BATCHES = web.AppKey("batches", Batches)


def batches_of(request: web.Request) -> Batches:
    return request.app[BATCHES]


async def read_large_body(request: web.Request, limit: int) -> bytearray:
    """The whole body, up to `limit` bytes (a batch's, not the app's smaller limit for live requests);
    not copied into `bytes` (64 MiB copied at once is a stall of the loop)."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"the body is larger than the {limit} bytes a batch may have")
    body = bytearray()
    async for chunk in request.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the body is larger than the {limit} bytes a batch may have")
    return body


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


def describe(errors: list[LineError], what: str | None = "line", more: bool = False) -> str:
    """The errors in one message: `line 3: messages: ...; line 7: ...` (`what` None: the messages alone;
    `more`: reading stopped at these, there may be others)."""
    shown = "; ".join(
        f"{what} {error.line}: {error.message}" if error.line and what else error.message
        for error in errors[:MAX_REPORTED_ERRORS]
    )
    if more:
        return f"{len(errors)} or more invalid (reading stopped at the first {len(errors)}): {shown}"
    return f"{len(errors)} invalid: {shown}" if len(errors) > 1 else shown


def gateway_batches(request: web.Request) -> tuple[Gateway, Batches]:
    return gateway_of(request), batches_of(request)


def owner(request: web.Request) -> str:
    """The owner of what this request creates, and the only one it finds (gateway/auth.py's owner_of)."""
    return owner_of(request)
