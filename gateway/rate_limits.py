"""Per-key rate limits: requests and tokens a minute, counted in Redis so every gateway shares them.

With API keys configured, each key may make `rate_limit_requests` requests and use
`rate_limit_tokens` tokens (prompt + completion) a minute; a line of the keys file may give a key
its own numbers (`sk-team-a requests=600 tokens=200000`), 0 = no limit. What counts: every POST
under /v1/ except the batch APIs' own calls; a batch's items count instead, each as a request with
its real tokens, charged to the key that owns the batch (gateway/batches/runner.py: `admit_owner`,
`charge_owner_once`, exactly once per item; an item waits while its key is over a limit).

The window is fixed and starts with a key's first request after the previous one ended (a
counter that expires 60 s after it was created). One Lua script reads both counters and counts
the request, so gateways that admit requests of one key at the same moment cannot both take the
last one; the script's two keys are one key's counters under one hash tag
(`lmq:ratelimit:{<digest>}:requests|tokens`), so on a Redis Cluster they share the slot a script
needs. Tokens are known only when an answer ends: a request is admitted while the key's tokens
in the window are below its limit, and what it cost is added when it ends. So a key can overshoot
its token limit by the requests it had running, never more.

What a request costs is counted per generation, not read from its access line: each choice of
`n` and each prompt of a legacy completion is charged its prompt tokens and every completion token
relayed (generation.py calls `count_tokens` as each one ends), and a request the client left is
charged too: its prompt (known from the worker's `started` event) and the tokens relayed so far.

Every answer to a limited key carries the headers its API documents (OpenAI:
`x-ratelimit-{limit,remaining,reset}-{requests,tokens}`; Anthropic:
`anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`); a refusal is a 429 with
`retry-after` (seconds) in the API's error shape (Anthropic's `rate_limit_error`, not the 529 it
uses for an overloaded service).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import math
import time
from contextvars import ContextVar
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.typedefs import Handler

from protocol.keys import rate_limit_key

from .auth import key_digest as _digest  # counters, owners and shares: one hash of a key, never the key
from .auth import key_file_options, presented_key
from .config import GatewayConfig
from .errors import api_of
from .metrics import Metrics

WINDOW_MS = 60_000
EXEMPT = ("/v1/files", "/v1/batches", "/v1/messages/batches")
_HEADERS = web.RequestKey("lmq_rate_limit_headers", dict) if hasattr(web, "RequestKey") else "lmq_rate_limit_headers"

# KEYS = [requests counter, tokens counter]; ARGV = [requests limit, tokens limit, window ms].
# Answers {refused ("" | "requests" | "tokens"), requests used, its ms to reset, tokens used, its ms to reset}.
ADMIT_LUA = r"""
local request_limit, token_limit, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local function used(key)
  local ttl = redis.call('PTTL', key)
  if ttl < 0 then return 0, window end
  return tonumber(redis.call('GET', key) or '0'), ttl
end
local requests, requests_reset = used(KEYS[1])
local tokens, tokens_reset = used(KEYS[2])
local refused = ''
if request_limit > 0 and requests >= request_limit then
  refused = 'requests'
elseif token_limit > 0 and tokens >= token_limit then
  refused = 'tokens'
elseif request_limit > 0 then
  requests = redis.call('INCR', KEYS[1])
  if requests == 1 then redis.call('PEXPIRE', KEYS[1], window) end
end
return {refused, requests, requests_reset, tokens, tokens_reset}
"""

# KEYS = [tokens counter]; ARGV = [tokens, window ms]
CHARGE_LUA = r"""
local total = redis.call('INCRBY', KEYS[1], ARGV[1])
if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return total
"""

# KEYS = [tokens counter, the charge's marker]; ARGV = [tokens, window ms, marker ms]: charged once by marker
CHARGE_ONCE_LUA = r"""
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[3]) then return 0 end
redis.call('INCRBY', KEYS[1], ARGV[1])
if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""
CHARGED_MS = 5 * WINDOW_MS  # a charge made again within this is not counted twice


@dataclass
class Ledger:
    """The tokens one HTTP request's generations used; shared by the tasks its choices run in."""

    tokens: int = 0


_ledger: ContextVar[Ledger | None] = ContextVar("lmq_rate_limit_ledger", default=None)


def count_tokens(tokens: int) -> None:
    """Charge `tokens` (one generation's prompt + completion) to the key of the request being handled."""
    ledger = _ledger.get()
    if ledger is not None and tokens > 0:
        ledger.tokens += tokens


@dataclass(frozen=True)
class Limits:
    requests: int = 0  # a minute; 0 = none
    tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.requests or self.tokens)


@dataclass(frozen=True)
class Window:
    """One key's counters as a request was admitted (or refused)."""

    limits: Limits
    refused: str  # "", "requests" or "tokens"
    requests: int
    requests_reset_ms: int
    tokens: int
    tokens_reset_ms: int

    @property
    def retry_after(self) -> int:
        reset = self.requests_reset_ms if self.refused == "requests" else self.tokens_reset_ms
        return max(1, math.ceil(reset / 1000))


def load_limits(config: GatewayConfig) -> dict[str, Limits]:
    """Each key's own limits from the keys file; `default` for every other key."""
    default = Limits(config.rate_limit_requests, config.rate_limit_tokens)
    limits = {}
    for key, options in key_file_options(config).items():
        unknown = set(options) - {"requests", "tokens"}
        if unknown:
            raise ValueError(
                f"{config.api_keys_file}: unknown option {sorted(unknown)[0]!r} for a key (requests=, tokens=)"
            )
        try:
            limits[key] = Limits(
                int(options.get("requests", default.requests)), int(options.get("tokens", default.tokens))
            )
        except ValueError:
            raise ValueError(f"{config.api_keys_file}: requests= and tokens= take whole numbers") from None
    return {"": default, **limits}


class RateLimiter:
    def __init__(self, redis: aioredis.Redis, limits: dict[str, Limits], metrics: Metrics):
        self.limits = limits
        self.metrics = metrics
        self._admit = redis.register_script(ADMIT_LUA)
        self._charge = redis.register_script(CHARGE_LUA)
        self._charge_once = redis.register_script(CHARGE_ONCE_LUA)

    def limits_for(self, key: str | None) -> Limits:
        return self.limits.get(key or "", self.limits[""]) if key else Limits()

    async def admit(self, key: str, limits: Limits) -> Window:
        digest = _digest(key)
        args = [limits.requests, limits.tokens, WINDOW_MS]
        refused, requests, requests_reset, tokens, tokens_reset = await self._admit(
            keys=[rate_limit_key(digest, "requests"), rate_limit_key(digest, "tokens")], args=args
        )
        refused = refused.decode() if isinstance(refused, bytes) else refused
        return Window(limits, refused or "", int(requests), int(requests_reset), int(tokens), int(tokens_reset))

    async def charge(self, key: str, tokens: int) -> None:
        if tokens > 0:
            await self._charge(keys=[rate_limit_key(_digest(key), "tokens")], args=[tokens, WINDOW_MS])

    # Batch items: their key is known only by its digest (a batch's owner, gateway/auth.py's key_digest,
    # the same hash that names the counters), never by the key itself.

    def limits_for_owner(self, owner: str) -> Limits:
        """The limits of the key whose digest is `owner`; none for "" (a gateway without keys)."""
        return self._by_digest.get(owner, self.limits[""]) if owner else Limits()

    @functools.cached_property
    def _by_digest(self) -> dict[str, Limits]:
        return {_digest(key): limits for key, limits in self.limits.items() if key}

    async def admit_owner(self, owner: str, limits: Limits) -> Window:
        """Count one batch item as a request of the key `owner`, as `admit` counts a live one."""
        args = [limits.requests, limits.tokens, WINDOW_MS]
        refused, requests, requests_reset, tokens, tokens_reset = await self._admit(
            keys=[rate_limit_key(owner, "requests"), rate_limit_key(owner, "tokens")], args=args
        )
        refused = refused.decode() if isinstance(refused, bytes) else refused
        return Window(limits, refused or "", int(requests), int(requests_reset), int(tokens), int(tokens_reset))

    async def charge_owner(self, owner: str, tokens: int) -> None:
        """Add a finished batch item's tokens to the key `owner`'s window."""
        if owner and tokens > 0:
            await self._charge(keys=[rate_limit_key(owner, "tokens")], args=[tokens, WINDOW_MS])

    async def charge_owner_once(self, owner: str, charge_id: str, tokens: int) -> None:
        """`charge_owner`, counted once for `charge_id` however often it is made within CHARGED_MS: a
        charge Redis took but whose reply was lost, or whose caller died before marking it paid, may
        be made again. The marker shares the counters' slot (their hash tag)."""
        if owner and tokens > 0:
            keys = [rate_limit_key(owner, "tokens"), rate_limit_key(owner, f"charged:{charge_id}")]
            await self._charge_once(keys=keys, args=[tokens, WINDOW_MS, CHARGED_MS])


def setup_rate_limits(app: web.Application, limiter: RateLimiter) -> None:
    """The limit check as the innermost middleware (after auth: the key is known and valid)."""
    if not any(limiter.limits.values()):
        return
    app.middlewares.append(_middleware(limiter))
    app.on_response_prepare.append(_add_headers)


def _middleware(limiter: RateLimiter):
    @web.middleware
    async def limit(request: web.Request, handler: Handler) -> web.StreamResponse:
        key = presented_key(request)
        limits = limiter.limits_for(key)
        if (
            not limits
            or request.method != "POST"
            or not request.path.startswith("/v1/")
            or request.path.startswith(EXEMPT)
        ):
            return await handler(request)
        assert key is not None
        window = await limiter.admit(key, limits)
        api = api_of(request)
        request[_HEADERS] = headers(api, window)
        if window.refused:
            limiter.metrics.errors.labels("rate_limited").inc()
            return refusal(api, window, request[_HEADERS])
        ledger = Ledger()
        token = _ledger.set(ledger)
        try:
            return await handler(request)
        finally:
            _ledger.reset(token)
            if limits.tokens:  # shielded: a client that hung up is charged all the same
                await asyncio.shield(limiter.charge(key, ledger.tokens))

    return limit


async def _add_headers(request: web.Request, response: web.StreamResponse) -> None:
    for name, value in request.get(_HEADERS, {}).items():
        response.headers[name] = value


def headers(api: str, window: Window) -> dict[str, str]:
    limits = window.limits
    counted = {
        "requests": (limits.requests, window.requests, window.requests_reset_ms),
        "tokens": (limits.tokens, window.tokens, window.tokens_reset_ms),
    }
    result = {}
    for kind, (limit, used, reset_ms) in counted.items():
        if not limit:
            continue
        remaining = str(max(0, limit - used))
        if api == "anthropic":
            reset = datetime.datetime.fromtimestamp(time.time() + reset_ms / 1000, datetime.UTC)
            prefix = f"anthropic-ratelimit-{kind}"
            result |= {
                f"{prefix}-limit": str(limit),
                f"{prefix}-remaining": remaining,
                f"{prefix}-reset": reset.isoformat(timespec="seconds").replace("+00:00", "Z"),
            }
        else:
            result |= {
                f"x-ratelimit-limit-{kind}": str(limit),
                f"x-ratelimit-remaining-{kind}": remaining,
                f"x-ratelimit-reset-{kind}": duration(reset_ms),
            }
    if window.refused:
        result["retry-after"] = str(window.retry_after)
    return result


def refusal(api: str, window: Window, headers: dict[str, str]) -> web.Response:
    what = "requests" if window.refused == "requests" else "tokens"
    limit = window.limits.requests if what == "requests" else window.limits.tokens
    message = f"rate limit reached: {limit} {what} a minute for this API key; retry in {window.retry_after} s"
    if api == "anthropic":
        body = {"type": "error", "error": {"type": "rate_limit_error", "message": message}}
    else:
        body = {"error": {"message": message, "type": what, "param": None, "code": "rate_limit_exceeded"}}
    return web.json_response(body, status=429, headers=headers)


def duration(ms: int) -> str:
    """OpenAI's reset format, a Go duration: `250ms`, `12.5s`, `1m30s`."""
    if ms < 1000:
        return f"{ms}ms"
    minutes, seconds = divmod(ms / 1000, 60)
    text = f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text
