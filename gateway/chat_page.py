"""The chat page at `/`: three static files from gateway/web/, public (the API calls it makes carry the key)."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

WEB = Path(__file__).parent / "web"
FILES = {  # path → (file in gateway/web/, content type)
    "/": ("index.html", "text/html"),
    "/static/app.js": ("app.js", "text/javascript"),
    "/static/style.css": ("style.css", "text/css"),
}
HEADERS = {
    # Everything comes from this gateway: no inline script, no CDN, no framing by other sites.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",  # revalidate, so a new version shows up at the next load
}


def _serve(name: str, content_type: str):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=(WEB / name).read_bytes(), content_type=content_type, charset="utf-8", headers=HEADERS)

    return handler


def add_chat_page(app: web.Application) -> None:
    for path, (name, content_type) in FILES.items():
        app.router.add_get(path, _serve(name, content_type))
