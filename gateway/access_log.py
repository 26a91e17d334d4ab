"""The gateway's access log and request ids.

Every request gets an id: the client's `X-Request-Id` when it sends a usable one (1-128 letters,
digits, `_`, `.`, `:`, `-`), else a new one; the response returns it in `X-Request-Id`. A
generation request's protocol id is that id, except that a client-chosen one is namespaced by its
owner (owned_id below): `<key tag>:<X-Request-Id>` where the gateway checks API keys, so two keys
choosing one id never meet on a worker. The access line's `request_id` is the protocol id, the one
the worker's log lines carry. When the request ends, one line on the logger `gateway.access`:

    request_id=chatcmpl-1f2e... method=POST path=/v1/chat/completions api=openai model=SmolLM2-135M-Instruct
    status=200 prompt_tokens=37 completion_tokens=32 ttft_ms=45 duration_ms=480

(one line; in JSON each of these is a field). Probes (/health, /ready, /metrics) log at DEBUG.
Status 499: the client went away before the answer ended.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import secrets
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

HEADER = "X-Request-Id"
PROBES = ("/health", "/ready", "/metrics")
CLIENT_CLOSED = 499  # nginx's code for a client that left before the answer was complete
_PLAIN = re.compile(r"^[A-Za-z0-9_.:/\-]+$")
_USABLE_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")  # the protocol's rule for request ids
# Room for a choice's `-<index>` (gateway/choices.py, at most 4 characters) within the protocol's 128.
MAX_OWNED_CHARS = 124

log = logging.getLogger("gateway.access")


@dataclass
class AccessRecord:
    """What the access line says about one request; handlers and generation.py fill it in."""

    started: float
    client_id: str | None  # the client's X-Request-Id, when usable
    request_id: str | None = None
    owner: str | None = (
        None  # the tag of the client's verified API key (`k` + 12 hex of auth.key_digest), set by gateway/auth.py
    )
    protocol_id: str | None = None  # the id workers saw, when it differs from request_id
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None  # time.monotonic()

    def id(self) -> str:
        if self.request_id is None:
            self.request_id = self.client_id or f"req-{secrets.token_hex(12)}"
        return self.request_id


_current: ContextVar[AccessRecord | None] = ContextVar("lmq_access_record", default=None)
_RECORD = web.RequestKey("lmq_access_record", AccessRecord) if hasattr(web, "RequestKey") else "lmq_access_record"


def request_id(prefix: str) -> str:
    """The id of the request being handled: the client's X-Request-Id, else a new `prefix<24 hex>`."""
    record = _current.get()
    if record is not None and record.client_id:
        record.request_id = record.client_id
        return record.client_id
    new = f"{prefix}{secrets.token_hex(12)}"
    if record is not None:
        record.request_id = new
    return new


def owned_id(request_id: str) -> str:
    """The protocol id for `request_id`: a client's own X-Request-Id gets its owner's tag in front.

    Without it, a client that knew (or guessed) another tenant's id could share that id's reply
    route, holder key and cancellations. Ids the gateway made (random) stay as they are. An owned id
    that would leave no room for a choice suffix keeps its first characters and a digest of the whole.
    """
    record = _current.get()
    if record is None or record.client_id is None or request_id != record.client_id:
        return request_id
    owned = request_id if record.owner is None else f"{record.owner}:{request_id}"
    if len(owned) > MAX_OWNED_CHARS:
        owned = f"{owned[: MAX_OWNED_CHARS - 17]}.{hashlib.sha256(owned.encode()).hexdigest()[:16]}"
    if owned != request_id:
        record.protocol_id = owned
    return owned


def note(**fields: Any) -> None:
    """Add what is known (model=, prompt_tokens=, completion_tokens=, first_token_at=) to the access line."""
    record = _current.get()
    if record is not None:
        for name, value in fields.items():
            setattr(record, name, value)


def tokens_used(request: web.Request) -> int:
    """Prompt + completion tokens the request's access line reports (0 before it knows them)."""
    record = request.get(_RECORD)
    if record is None:
        return 0
    return (record.prompt_tokens or 0) + (record.completion_tokens or 0)


def usable_id(value: str | None) -> str | None:
    return value if value is not None and _USABLE_ID.match(value) else None


def setup_access_log(app: web.Application) -> None:
    """The access log as the outermost middleware (it sees the final status), and the X-Request-Id header."""
    app.middlewares.insert(0, access_log_middleware)
    app.on_response_prepare.append(_add_request_id)


@web.middleware
async def access_log_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    record = AccessRecord(started=time.monotonic(), client_id=usable_id(request.headers.get(HEADER)))
    request[_RECORD] = record
    token = _current.set(record)
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    finally:
        _current.reset(token)
        _log(request, record, status)


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    record = request.get(_RECORD)
    if record is not None:
        response.headers[HEADER] = record.id()


def _api(path: str) -> str | None:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/"):
        return "openai"
    return None


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


def _value(value: Any) -> str:
    """A logfmt value: bare when plain, else quoted (a path may hold spaces, quotes or newlines)."""
    if value is None:
        return "-"
    text = str(value)
    return text if _PLAIN.match(text) else json.dumps(text)


def _log(request: web.Request, record: AccessRecord, status: int) -> None:
    now = time.monotonic()
    fields = {
        "request_id": record.protocol_id or record.id(),
        "method": request.method,
        "path": request.path,
        "api": _api(request.path),
        "model": record.model,
        "status": status,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "ttft_ms": _ms(record.first_token_at - record.started if record.first_token_at is not None else None),
        "duration_ms": _ms(now - record.started),
    }
    level = logging.DEBUG if request.path in PROBES else logging.INFO
    if log.isEnabledFor(level):
        text = " ".join(f"{name}={_value(value)}" for name, value in fields.items())
        log.log(level, "%s", text, extra=fields)
