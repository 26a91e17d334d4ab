"""Server-sent events: each event written (and so sent) as soon as it is ready."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from .context import gateway_of
from .errors import ApiError

log = logging.getLogger(__name__)


class TimedStream(web.StreamResponse):
    """A stream whose every write must be taken by the client within `write_timeout` seconds.

    A write waits (aiohttp drains) once the socket's buffer is full, so what a client that stopped
    reading holds is the socket's buffer plus what arrives for it meanwhile; past the timeout the
    connection is aborted with a logged reason and the write raises ConnectionResetError, which
    ends the request as a hang-up would (its work withdrawn). Other streams never wait on it."""

    def __init__(self, request: web.Request, write_timeout: float, **kwargs: Any):
        super().__init__(**kwargs)
        self._request = request
        self.write_timeout = write_timeout

    async def write(self, data: bytes) -> None:
        try:
            async with asyncio.timeout(self.write_timeout):
                await super().write(data)
        except TimeoutError:
            log.warning(
                "cut %s %s from %s: the client read nothing for %g s",
                self._request.method,
                self._request.path,
                self._request.remote,
                self.write_timeout,
            )
            if self._request.transport is not None:
                self._request.transport.abort()
            raise ConnectionResetError("the client stopped reading") from None


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = TimedStream(
        request,
        gateway_of(request).config.write_timeout,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # tell proxies (nginx) not to hold events back
        },
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
