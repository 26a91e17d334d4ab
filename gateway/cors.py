"""CORS, off by default: with `--allowed-origins`, browser pages on those origins may call the API.

A preflight (OPTIONS with `Origin` and `Access-Control-Request-Method`) from an allowed origin is
answered 204 before auth (browsers never send credentials with it); every other response to an
allowed origin gets `Access-Control-Allow-Origin` and the exposed headers, streams included (set in
`on_response_prepare`, which runs before a stream's headers go out). A disallowed origin gets no
CORS headers, so the browser keeps the answer from the page.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

ALLOW_METHODS = "GET, POST, OPTIONS"
# Allowed when a preflight names none; a preflight that names headers gets them back (the origin is
# trusted already, and browser SDKs send their own, e.g. OpenAI's x-stainless-*).
ALLOW_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta, X-Request-Id"
EXPOSE_HEADERS = "X-Request-Id, Retry-After"
MAX_AGE = "600"  # seconds a browser may cache a preflight answer


def parse_origins(text: str) -> frozenset[str]:
    """`https://a.example, http://localhost:3000/` → the set of origins; `*` allows any."""
    return frozenset(origin.strip().rstrip("/").lower() for origin in text.split(",") if origin.strip())


class Cors:
    def __init__(self, origins: frozenset[str]):
        self.any = "*" in origins
        self.origins = origins

    def allow_origin(self, request: web.Request) -> str | None:
        """The Access-Control-Allow-Origin value for this request, or None if its origin is not allowed."""
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        if self.any:
            return "*"
        return origin if origin.rstrip("/").lower() in self.origins else None

    def middleware(self) -> Middleware:
        @web.middleware
        async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
            is_preflight = request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
            if not is_preflight or self.allow_origin(request) is None:
                return await handler(request)
            requested = request.headers.get("Access-Control-Request-Headers", "").strip()
            headers = {
                "Access-Control-Allow-Methods": ALLOW_METHODS,
                "Access-Control-Allow-Headers": requested or ALLOW_HEADERS,
                "Access-Control-Max-Age": MAX_AGE,
            }
            return web.Response(status=204, headers=headers)

        return preflight

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        allowed = self.allow_origin(request)
        if allowed is None:
            return
        response.headers["Access-Control-Allow-Origin"] = allowed
        response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
        if allowed != "*":
            vary = response.headers.get("Vary")
            response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"


def setup_cors(app: web.Application, allowed_origins: str) -> None:
    """Answer preflights (the outermost middleware, as in vLLM: before auth, metrics and logs) and
    add the CORS headers to every response; nothing at all when `allowed_origins` is empty."""
    origins = parse_origins(allowed_origins)
    if not origins:
        return
    cors = Cors(origins)
    app.middlewares.insert(0, cors.middleware())
    app.on_response_prepare.append(cors.on_prepare)
