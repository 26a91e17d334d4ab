"""The gateway's access log and request ids.

Every request gets an id: the client's `X-Request-Id` when it sends a usable one (1-128 letters,
digits, `_`, `.`, `:`, `-`), else a new one. A generation request uses it as its protocol id, so
the worker's log lines carry it too, and the response returns it in `X-Request-Id`. When the
request ends, one line on the logger `gateway.access`:

    request_id=chatcmpl-1f2e... method=POST path=/v1/chat/completions api=openai model=SmolLM2-135M-Instruct
    status=200 prompt_tokens=37 completion_tokens=32 ttft_ms=45 duration_ms=480

(one line; in JSON each of these is a field). Probes (/health, /ready, /metrics) log at DEBUG.
Status 499: the client went away before the answer ended.
"""

from __future__ import annotations

import asyncio
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

log = logging.getLogger("gateway.access")


@dataclass
class AccessRecord:
    """What the access line says about one request; handlers and generation.py fill it in."""

    started: float
    client_id: str | None  # the client's X-Request-Id, when usable
    request_id: str | None = None
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
        "request_id": record.id(),
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
