"""OpenAI's Responses API on the queue (docs/api.md): POST /v1/responses and what the stored responses allow.

params.py checks a request and maps it onto the chat path; conversation.py turns input items (and a
stored response's output) into chat messages; builder.py makes the output items and stream events;
store.py keeps responses in Redis, owned per API key; background.py runs `background: true`
responses on whichever gateway holds their lease; api.py has the handlers.
"""

from __future__ import annotations

from aiohttp import web

from ..context import GATEWAY
from . import api
from .background import background_runner
from .store import ResponseStore


def add_response_routes(app: web.Application) -> None:
    """The endpoints, and the background runner for the application's lifetime (needs `app[GATEWAY]`)."""
    gateway = app[GATEWAY]
    store = ResponseStore(gateway.redis, gateway.shards.home, int(gateway.config.response_ttl))
    app[api.RESPONSES] = api.Responses(store, background_runner(gateway, store))
    app.cleanup_ctx.append(app[api.RESPONSES].runner.lifetime)
    router = app.router
    router.add_post("/v1/responses", api.create)
    router.add_post("/v1/responses/input_tokens", api.input_tokens)
    router.add_get("/v1/responses/{response_id}", api.retrieve)
    router.add_delete("/v1/responses/{response_id}", api.delete)
    router.add_get("/v1/responses/{response_id}/input_items", api.input_items)
    router.add_post("/v1/responses/{response_id}/cancel", api.cancel)
