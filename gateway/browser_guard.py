"""Guards against a web page driving an lmq it can reach (a local one, usually without keys).

- JSON bodies only: a page may POST `text/plain` (or a form) to any origin without a preflight, so a
  POST with a body that is not `application/json` is refused with 415 on every endpoint but the
  file upload (multipart, `/v1/files`). A POST without a body (a cancel) carries nothing to refuse.
- The Host header (DNS rebinding: a page whose own name resolves to 127.0.0.1 reads the answers):
  refused with 403 unless it names an allowed host (`--allowed-hosts`; by default, when listening on
  a loopback address, the localhost names and that address; when listening on any other address,
  any Host, since the names a network reaches it by are not known here; set the list, and keys).
- Cross-site writes: a POST without a body (a batch cancel) needs no preflight either, so a POST or
  DELETE whose `Origin` is neither this gateway's own (same scheme-less host:port as `Host`) nor
  one of `--allowed-origins` is refused with 403. Clients other than browsers send no `Origin`.
"""

from __future__ import annotations

import ipaddress

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .errors import ApiError

MULTIPART_PATHS = ("/v1/files",)
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(setting: str, listen_host: str) -> frozenset[str] | None:
    """The Host names accepted (lower case, no port); None accepts any. `setting` is comma-separated, `*` any."""
    names = frozenset(name.strip().lower().strip("[]") for name in setting.split(",") if name.strip())
    if "*" in names:
        return None
    if names:
        return names
    return frozenset(LOCAL_NAMES) | {listen_host.lower().strip("[]")} if _is_loopback(listen_host) else None


def host_name(header: str) -> str:
    """`Host` without its port: `localhost:8000` → localhost, `[::1]:8000` → ::1."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def _foreign_origin(request: web.Request, origins: frozenset[str]) -> bool:
    origin = request.headers.get("Origin")
    if origin is None or request.method in ("GET", "HEAD", "OPTIONS"):
        return False
    origin = origin.strip().rstrip("/").lower()
    same = origin.partition("://")[2] == request.headers.get("Host", "").strip().lower()
    return not (same or "*" in origins or origin in origins)


def guard_middleware(hosts: frozenset[str] | None, origins: frozenset[str] = frozenset()) -> Middleware:
    """`hosts` as allowed_hosts gives them; `origins` the CORS origins (cors.parse_origins) that may write."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if hosts is not None and host_name(request.headers.get("Host", "")) not in hosts:
            raise ApiError(
                403,
                "the Host header names a host this gateway does not serve (see --allowed-hosts)",
                code="host_not_allowed",
            )
        if _foreign_origin(request, origins):
            raise ApiError(
                403, "a page of another origin may not write here (see --allowed-origins)", code="origin_not_allowed"
            )
        if (
            request.method == "POST"
            and request.body_exists
            and not request.path.startswith(MULTIPART_PATHS)
            and request.content_type != "application/json"
        ):
            raise ApiError(
                415,
                f"Content-Type must be application/json, not {request.content_type!r}",
                code="unsupported_media_type",
            )
        return await handler(request)

    return guard
