"""Anthropic's Message Batches: POST/GET /v1/messages/batches, GET/DELETE /v1/messages/batches/{id},
POST .../{id}/cancel, GET .../{id}/results.

A batch's format is checked when it is created (parse.py: a custom_id of 1-64 letters, digits, `_`
or `-`, unique; `params` naming a model; a malformed request: 400 naming `requests.<i>`); each
request's `params` is checked as POST /v1/messages checks a body when it runs, as Anthropic does:
a bad one ends that request `errored` with the endpoint's error, and the others run. `processing_status` is
`in_progress`, `canceling`, then `ended`; `request_counts` move as items finish (Anthropic's own
service shows them only at the end); `results_url` appears once it has ended. Results are JSONL,
one line per request in input order: `{custom_id, result: {type: succeeded | errored | canceled |
expired, ...}}`. A batch can be deleted once it has ended.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from aiohttp import web

from ..errors import ApiError
from . import outputs, parse
from .service import LineError, describe, gateway_batches, owner, page_limit, read_large_body
from .store import OUTCOMES, Batch

PROCESSING = {
    "cancelling": "canceling",
    "completed": "ended",
    "cancelled": "ended",
    "expired": "ended",
    "failed": "ended",
}


def _time(value: float | None) -> str | None:
    if value is None:
        return None
    return (
        datetime.datetime.fromtimestamp(value, datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def batch_object(batch: Batch, base_url: str) -> dict[str, Any]:
    counts = {outcome: batch.number(outcome) for outcome in OUTCOMES}
    ended_at = next(
        (
            batch.time(f"{status}_at")
            for status in ("completed", "cancelled", "expired", "failed")
            if batch.time(f"{status}_at")
        ),
        None,
    )
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": PROCESSING.get(batch.status, "in_progress"),
        "request_counts": {"processing": batch.total - sum(counts.values()), **counts},
        "ended_at": _time(ended_at),
        "created_at": _time(batch.time("created_at")),
        "expires_at": _time(batch.time("expires_at")),
        "archived_at": None,
        "cancel_initiated_at": _time(batch.time("cancelling_at")),
        "results_url": f"{base_url}/v1/messages/batches/{batch.id}/results" if batch.ended else None,
    }


def _base_url(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


async def create(request: web.Request) -> web.Response:
    gateway, batches = gateway_batches(request)
    raw = await read_large_body(request, gateway.config.batch_max_bytes)
    try:
        parsed = await parse.anthropic_body(gateway, raw)
    except ValueError as exc:
        raise ApiError(
            400, f"the body is not a batch ({{requests: [{{custom_id, params}}]}} as JSON): {exc}", param="requests"
        ) from None
    if parsed.errors:
        errors = [_named(error) for error in parsed.errors]
        raise ApiError(400, describe(errors, None, more=parsed.more_errors))
    served = await gateway.models.served(fresh=True)
    for model in sorted(parsed.models - served):
        raise ApiError(404, f"the model {model!r} does not exist or no worker serves it", code="model_not_found")
    fields = {
        "status": "in_progress",
        "in_progress_at": repr(time.time()),
        "expires_at": repr(time.time() + gateway.config.batch_window_seconds),
    }
    batch = await batches.store.create_batch("msgbatch_", "anthropic", owner(request), fields, parsed.items)
    batches.runner.wake()
    return web.json_response(batch_object(batch, _base_url(request)))


def _named(error: LineError) -> LineError:
    """`requests.<i>.<field>: ...` (`requests.<i>.params.<field>` for a field of the params)."""
    if not error.line and not error.param:
        return error
    inside = "params." if (error.param or "").startswith("body") else ""
    return LineError(error.line, f"requests.{error.line}.{inside}{error.message}")


async def retrieve(request: web.Request) -> web.Response:
    return web.json_response(batch_object(await _batch(request), _base_url(request)))


async def list_batches(request: web.Request) -> web.Response:
    _, batches = gateway_batches(request)
    found, has_more = await batches.store.batches(
        "anthropic",
        owner(request),
        request.query.get("after_id"),
        request.query.get("before_id"),
        page_limit(request, 20, 1000),
    )
    data = [batch_object(batch, _base_url(request)) for batch in found]
    return web.json_response(
        {
            "data": data,
            "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )


async def cancel(request: web.Request) -> web.Response:
    batch = await _batch(request)
    store = gateway_batches(request)[1].store
    await store.cancel(batch.id)  # an ended batch stays as it is
    return web.json_response(batch_object(await store.batch(batch.id) or batch, _base_url(request)))


async def delete(request: web.Request) -> web.Response:
    batch = await _batch(request)
    if not batch.ended:
        raise ApiError(400, f"Batch {batch.id} cannot be deleted while it is processing; cancel it first")
    await gateway_batches(request)[1].store.delete_batch(batch)
    return web.json_response({"id": batch.id, "type": "message_batch_deleted"})


async def results(request: web.Request) -> web.StreamResponse:
    batch = await _batch(request)
    if not batch.ended:
        raise ApiError(400, f"Batch {batch.id} has not finished processing; its results come once it has ended")
    response = web.StreamResponse(headers={"Content-Type": "application/binary"})
    await response.prepare(request)
    gateway, batches = gateway_batches(request)
    async for line in outputs.anthropic_results(batches.store, batch, gateway.config.thinking_secret):
        await response.write(line)
    await response.write_eof()
    return response


async def _batch(request: web.Request) -> Batch:
    batch_id = request.match_info["batch_id"]
    batch = await gateway_batches(request)[1].store.owned_batch(batch_id, "anthropic", owner(request))
    if batch is None:  # also a malformed id, and another key's batch: the same 404
        raise ApiError(404, f"No batch found with id {batch_id!r}")
    return batch
