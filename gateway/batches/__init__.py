"""Batch jobs on the queue: OpenAI's Batch API and Anthropic's Message Batches (docs/batches.md).

A batch's items run as protocol requests of priority `batch`, which workers take only with
spare capacity, so interactive traffic is always served first. Its state, items and results live
in Redis (store.py) and every gateway runs a runner (runner.py) that drives the batches it holds a
lease on, so a batch survives gateway and worker restarts and continues where it was.
"""

from __future__ import annotations

from aiohttp import web

from ..context import GATEWAY
from . import anthropic_api, files, openai_api
from .runner import batch_runner
from .service import BATCHES, Batches
from .store import BatchStore


def add_batch_routes(app: web.Application) -> None:
    """The batch endpoints, and the runner for the application's lifetime (needs `app[GATEWAY]`)."""
    gateway = app[GATEWAY]
    store = BatchStore(gateway.redis, gateway.shards.home)
    app[BATCHES] = Batches(gateway, store, batch_runner(gateway, store))
    app.cleanup_ctx.append(app[BATCHES].runner.lifetime)  # stopping it hands this gateway's batches back
    router = app.router
    router.add_post("/v1/files", files.upload)
    router.add_get("/v1/files", files.list_files)
    router.add_get("/v1/files/{file_id}", files.retrieve)
    router.add_get("/v1/files/{file_id}/content", files.content)
    router.add_delete("/v1/files/{file_id}", files.delete)
    router.add_post("/v1/batches", openai_api.create)
    router.add_get("/v1/batches", openai_api.list_batches)
    router.add_get("/v1/batches/{batch_id}", openai_api.retrieve)
    router.add_post("/v1/batches/{batch_id}/cancel", openai_api.cancel)
    router.add_post("/v1/messages/batches", anthropic_api.create)
    router.add_get("/v1/messages/batches", anthropic_api.list_batches)
    router.add_get("/v1/messages/batches/{batch_id}", anthropic_api.retrieve)
    router.add_delete("/v1/messages/batches/{batch_id}", anthropic_api.delete)
    router.add_post("/v1/messages/batches/{batch_id}/cancel", anthropic_api.cancel)
    router.add_get("/v1/messages/batches/{batch_id}/results", anthropic_api.results)
