"""What this gateway and its workers are doing: /v1/models, /health, /ready, /metrics."""

from __future__ import annotations

from aiohttp import web
from redis.exceptions import RedisError

from .context import gateway_of


def _openai_model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "lmq"}


def _anthropic_model(name: str) -> dict:
    return {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}


def _wants_anthropic_shape(request: web.Request) -> bool:
    return "anthropic-version" in request.headers


async def list_models(request: web.Request) -> web.Response:
    names = sorted(await gateway_of(request).models.served(fresh=True))
    if _wants_anthropic_shape(request):
        data = [_anthropic_model(name) for name in names]
        return web.json_response(
            {
                "data": data,
                "has_more": False,
                "first_id": names[0] if names else None,
                "last_id": names[-1] if names else None,
            }
        )
    return web.json_response({"object": "list", "data": [_openai_model(name) for name in names]})


async def get_model(request: web.Request) -> web.Response:
    name = await gateway_of(request).models.require(request.match_info["model"])
    return web.json_response(_anthropic_model(name) if _wants_anthropic_shape(request) else _openai_model(name))


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready when Redis answers, this gateway hears replies, and some worker serves some model.
    Probes call it often, and reading the heartbeats SCANs the keyspace: the view is at most
    CACHE_SECONDS old, however many probes ask (re-read at once while it shows no worker, so a
    gateway turns ready as soon as its first worker beats; concurrent re-reads are one)."""
    gateway = gateway_of(request)
    if not gateway.replies.listening:
        return web.json_response(
            {"status": "unavailable", "reason": "the reply subscription is reconnecting"}, status=503
        )
    try:
        models = sorted(await gateway.models.served() or await gateway.models.served(fresh=True))
    except RedisError as exc:
        return web.json_response({"status": "unavailable", "reason": f"redis: {exc}"}, status=503)
    if not models:
        return web.json_response({"status": "unavailable", "reason": "no live worker"}, status=503)
    return web.json_response({"status": "ready", "models": models})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text; the queue depths are read from Redis now, for the models live workers serve
    (left out while Redis does not answer: the gateway's own metrics matter most then)."""
    gateway = gateway_of(request)
    try:
        depths = {model: await gateway.queue.waiting(model) for model in await gateway.models.served()}
    except RedisError:
        depths = {}
    gateway.metrics.queue_depth.clear()  # a model no longer served leaves the list
    for model, depth in depths.items():
        gateway.metrics.queue_depth.labels(model).set(depth)
    return web.Response(body=gateway.metrics.render(), headers={"Content-Type": gateway.metrics.content_type})
