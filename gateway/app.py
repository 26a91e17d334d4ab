"""The gateway's aiohttp application: routes, middlewares, and the Redis-backed state they share."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Handler
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

import protocol
from protocol.cancelling import honour_lost_cancel
from protocol.cluster_url import shard_layout
from protocol.keys import ShardLayout
from protocol.redis_client import connect

from . import anthropic, openai, status, tokenize
from .access_log import setup_access_log
from .auth import auth_middleware, load_api_keys
from .batches import add_batch_routes
from .browser_guard import allowed_hosts, guard_middleware
from .chat_page import add_chat_page
from .config import GatewayConfig
from .context import GATEWAY, Gateway
from .cors import parse_origins, setup_cors
from .errors import ApiError, api_of, error_response
from .metrics import Metrics, metrics_middleware
from .queue import RequestQueue
from .queue_share import QueueShare, setup_queue_share
from .rate_limits import RateLimiter, load_limits, setup_rate_limits
from .replies import ReplyRouter
from .responses import add_response_routes
from .sharded_replies import ShardedReplyRouter
from .workers import ModelRegistry

log = logging.getLogger(__name__)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error, ours or aiohttp's (404, 405, 413), in the shape of the API the client called."""
    try:
        return await handler(request)
    except ApiError as error:
        failure = error
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        failure = ApiError(exc.status, _http_message(request, exc))
    except (
        RedisConnectionError,
        RedisTimeoutError,
        RedisClusterException,
    ) as exc:  # the last: no node of a cluster answers
        log.warning("redis unavailable: %s", exc)
        failure = ApiError(503, "the request queue is unavailable; retry later", code="unavailable")
    except RedisError as exc:
        log.error("redis refused a command: %s", exc)
        failure = ApiError(503, "the request queue refused the request; retry later", code="unavailable")
    request.app[GATEWAY].metrics.errors.labels(failure.label).inc()
    return error_response(api_of(request), failure)


def reply_router(redis, shards: ShardLayout, gateway_id: str) -> ReplyRouter:
    """One plain pub/sub channel on one Redis; one sharded channel per shard on a cluster."""
    if shards.home.tag is None:
        return ReplyRouter(redis, protocol.gateway_reply_channel(gateway_id))
    return ShardedReplyRouter(redis, shards, gateway_id)


def create_app(config: GatewayConfig) -> web.Application:
    redis = connect(config.redis_url)
    shards = shard_layout(config.redis_url)
    keys = load_api_keys(config)
    share = QueueShare(redis, config.max_queue_per_key, config.pickup_timeout, config.retry_after) if keys else None
    metrics = Metrics()
    gateway = Gateway(
        config=config,
        redis=redis,
        replies=reply_router(redis, shards, config.gateway_id),
        queue=RequestQueue(redis, shards, config.max_queue, config.retry_after, share),
        models=ModelRegistry(redis, shards.home),
        metrics=metrics,
        shards=shards,
        limiter=RateLimiter(redis, load_limits(config), metrics) if keys else None,
    )
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[
            metrics_middleware(gateway.metrics),
            error_middleware,
            guard_middleware(
                allowed_hosts(config.allowed_hosts, config.host), parse_origins(config.allowed_origins)
            ),  # before auth: a page gets refused whatever it sends
            auth_middleware(keys),
        ],
    )
    app[GATEWAY] = gateway
    setup_access_log(app)  # before CORS: its preflight middleware stays outermost
    setup_cors(app, config.allowed_origins)
    if keys:  # limits are per API key
        setup_queue_share(app)
        setup_rate_limits(app, gateway.limiter)
    app.cleanup_ctx.append(_subscribed)
    app.router.add_post("/v1/chat/completions", openai.chat_completions)
    app.router.add_post("/v1/completions", openai.completions)
    app.router.add_post("/v1/messages", anthropic.messages)
    app.router.add_post("/v1/messages/count_tokens", anthropic.count_tokens)
    app.router.add_post("/tokenize", tokenize.tokenize)
    app.router.add_post("/detokenize", tokenize.detokenize)
    app.router.add_get("/v1/models", status.list_models)
    app.router.add_get("/v1/models/{model}", status.get_model)
    app.router.add_get("/health", status.health)
    app.router.add_get("/ready", status.ready)
    app.router.add_get("/metrics", status.metrics)
    add_chat_page(app)
    add_batch_routes(app)
    add_response_routes(app)
    return app


async def _subscribed(app: web.Application) -> AsyncIterator[None]:
    """Subscribe to this gateway's reply channel before the first request; close everything at the end."""
    gateway = app[GATEWAY]
    await gateway.replies.start()
    yield
    await gateway.replies.stop()
    await gateway.redis.aclose()


async def run_gateway(config: GatewayConfig, *, listening: asyncio.Event | None = None) -> None:
    """Serve until cancelled; `listening` is set once the port is bound. A client that disconnects
    cancels its handler (and so its request)."""
    runner = web.AppRunner(create_app(config), handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        log.info("gateway %s listening on http://%s:%d", config.gateway_id, config.host, config.port)
        if listening is not None:
            listening.set()
        honour_lost_cancel()  # one that arrived during setup, inside redis-py's connect
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def _http_message(request: web.Request, exc: web.HTTPException) -> str:
    """aiohttp's routing errors say only "404: Not Found"; name what was asked for."""
    if isinstance(exc, web.HTTPNotFound) and (exc.text or "").startswith("404:"):
        return f"no such endpoint: {request.method} {request.path} (docs/api.md lists them)"
    if isinstance(exc, web.HTTPMethodNotAllowed) and (exc.text or "").startswith("405:"):
        return f"{request.path} does not take {request.method}; it takes {', '.join(sorted(exc.allowed_methods))}"
    return exc.text or exc.reason
