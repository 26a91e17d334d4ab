"""Optional API keys, accepted as `Authorization: Bearer <key>` or `x-api-key: <key>`.

With keys set, every endpoint needs one but the open ones: /health and /ready (probes carry no
key) and the chat page's static files (they hold no data; the API calls the page makes carry the
key). /metrics needs one too: Prometheus scrapes it with `authorization: {credentials: <key>}`.

A line of the keys file may give the key its own rate limits after it (gateway/rate_limits.py):
`sk-team-a requests=600 tokens=200000`; the words after the key are options, never part of it.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from . import access_log
from .config import GatewayConfig
from .errors import ApiError

OPEN_PATHS = frozenset({"/health", "/ready", "/", "/static/app.js", "/static/style.css"})
_OWNER = web.RequestKey("lmq_owner", str) if hasattr(web, "RequestKey") else "lmq_owner"


def load_api_keys(config: GatewayConfig) -> frozenset[str]:
    """Keys from `api_keys` (comma-separated) and `api_keys_file` (one a line, `#` comments); empty = no auth."""
    keys = [key.strip() for key in config.api_keys.split(",")]
    keys += list(key_file_options(config))
    return frozenset(key for key in keys if key)


def key_file_options(config: GatewayConfig) -> dict[str, dict[str, str]]:
    """Each key of `api_keys_file` with the `name=value` options that follow it on its line."""
    if not config.api_keys_file:
        return {}
    keys: dict[str, dict[str, str]] = {}
    for number, line in enumerate(Path(config.api_keys_file).read_text(encoding="utf-8").splitlines(), start=1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        options = dict(word.partition("=")[::2] for word in words[1:])
        if any(not name or not value for name, value in options.items()):
            raise ValueError(f"{config.api_keys_file}, line {number}: options after a key are name=value words")
        keys[words[0]] = options
    return keys


def presented_key(request: web.Request) -> str | None:
    authorization = request.headers.get("Authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key")


def key_digest(key: str) -> str:
    """A key's identity where lmq writes one (owners, rate-limit counters): a hash, never the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def owner_of(request: web.Request) -> str:
    """Who owns what this request creates or reads (files, batches): the digest of its verified key, or
    "" (one anonymous owner) on a gateway that takes no keys, whatever key a client sends there."""
    return request.get(_OWNER, "")


def _is_known(key: str, keys: frozenset[str]) -> bool:
    # compare with every key, in constant time, so timing tells nothing about near misses
    return any([hmac.compare_digest(key.encode(), known.encode()) for known in keys])


def auth_middleware(keys: frozenset[str]) -> Middleware:
    @web.middleware
    async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if keys and request.path not in OPEN_PATHS:
            key = presented_key(request)
            if key is None:
                raise ApiError(
                    401, "no API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`", code="invalid_api_key"
                )
            if not _is_known(key, keys):
                raise ApiError(401, "the API key is not valid", code="invalid_api_key")
            request[_OWNER] = key_digest(key)
            access_log.note(owner="k" + request[_OWNER][:12])  # request ids are namespaced by it
        return await handler(request)

    return require_key
