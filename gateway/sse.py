"""Server-sent events: each event written (and so sent) as soon as it is ready."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


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
