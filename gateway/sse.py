"""Server-sent events: each event written (and so sent) as soon as it is ready."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from .errors import ApiError


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # tell proxies (nginx) not to hold events back
        }
    )
    await response.prepare(request)
    return response


async def send(response: web.StreamResponse, data: dict[str, Any] | str, event: str | None = None) -> None:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    await response.write(f"{head}data: {payload}\n\n".encode())


async def send_comment(response: web.StreamResponse, text: str) -> None:
    """A comment line: SSE clients ignore it; it keeps proxies from timing out an idle stream."""
    await response.write(f": {text}\n\n".encode())


async def relay_in_stream(
    request: web.Request,
    relay: Callable[[web.StreamResponse], Awaitable[None]],
    error_body: Callable[[ApiError], dict[str, Any]],
    errors: Counter,
    error_event: str | None = None,
) -> web.StreamResponse:
    """Open the stream and run `relay` in it. Once the stream is open an error goes inside it, in
    the API's own shape; a client that left ends it quietly (leaving the Generation block then
    withdraws the request)."""
    response = await open_stream(request)
    with suppress(ConnectionResetError):
        try:
            await relay(response)
        except ApiError as error:
            errors.labels(error.label).inc()
            await send(response, error_body(error), event=error_event)
    return response
