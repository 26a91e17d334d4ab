"""OpenAI's Batch API: POST /v1/batches, GET /v1/batches[/{id}], POST /v1/batches/{id}/cancel.

Statuses: `validating` (created; the runner starts it at once) → `in_progress` → `finalizing`
(writing the output and error files) → `completed`; or `failed` (the input does not fit the batch:
a line for another endpoint, a model no worker serves; `errors` says which lines), `cancelling` →
`cancelled`, `expired` (the completion window ended first). `request_counts.completed` counts the
items that succeeded, `failed` every other finished one. A line whose body the endpoint refuses does not fail the
batch: that item ends `errored` (its line in the error file has the endpoint's status and error).
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from ..errors import ApiError
from ..validate import read_json_object, required_str
from . import items, parse
from .service import LineError, gateway_batches, owner, page_limit
from .store import Batch

WINDOW = "24h"
MAX_METADATA = 16


def _seconds(value: float | None) -> int | None:
    return int(value) if value is not None else None


def batch_object(batch: Batch) -> dict[str, Any]:
    times = {
        name: _seconds(batch.time(name))
        for name in (
            "in_progress_at",
            "finalizing_at",
            "completed_at",
            "failed_at",
            "expired_at",
            "cancelling_at",
            "cancelled_at",
        )
    }
    errors = batch.json("errors")
    succeeded = batch.number("succeeded")
    prompt, completion = batch.number("prompt_tokens"), batch.number("completion_tokens")
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.fields.get("endpoint"),
        "model": batch.fields.get("model"),
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": batch.fields.get("input_file_id"),
        "completion_window": batch.fields.get("completion_window", WINDOW),
        "status": batch.status,
        "output_file_id": batch.fields.get("output_file_id"),
        "error_file_id": batch.fields.get("error_file_id"),
        "created_at": _seconds(batch.time("created_at")),
        "expires_at": _seconds(batch.time("expires_at")),
        **times,
        "request_counts": {"total": batch.total, "completed": succeeded, "failed": batch.finished - succeeded},
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": batch.number("cached_tokens")},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
        "metadata": batch.json("metadata"),
    }


def _metadata(body: dict[str, Any]) -> dict[str, str] | None:
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA
        or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()
        )
    ):
        raise ApiError(
            400,
            "metadata: at most 16 string keys (64 characters) with string values (512 characters)",
            param="metadata",
        )
    return metadata


async def create(request: web.Request) -> web.Response:
    gateway, batches = gateway_batches(request)
    body = await read_json_object(request)
    endpoint = required_str(body, "endpoint")
    if endpoint not in items.OPENAI_ENDPOINTS:
        raise ApiError(400, f"endpoint: lmq runs batches of {' and '.join(items.OPENAI_ENDPOINTS)}", param="endpoint")
    if required_str(body, "completion_window") != WINDOW:
        raise ApiError(400, f'completion_window: must be "{WINDOW}"', param="completion_window")
    metadata = _metadata(body)
    file_id = required_str(body, "input_file_id")
    record = await batches.store.file(file_id, owner(request))
    if record is None:  # also a malformed id, and another key's file
        raise ApiError(404, f"No such File object: {file_id}", param="input_file_id", code="not_found")
    if record.fields.get("purpose") != "batch":
        raise ApiError(400, f"input_file_id: {file_id} was not uploaded with purpose=batch", param="input_file_id")
    parsed = await parse.openai_file(gateway, await batches.store.file_data(file_id), (endpoint,))
    served = await gateway.models.served(fresh=True)
    errors = parsed.errors + [
        LineError(0, f"model: no worker serves {model!r}", "body.model", "model_not_found")
        for model in sorted(parsed.models - served)
    ]
    now = time.time()
    fields = {
        "endpoint": endpoint,
        "input_file_id": file_id,
        "completion_window": WINDOW,
        "metadata": _json(metadata),
        "model": json.loads(parsed.items[0])["body"]["model"] if parsed.items else "",
        "expires_at": repr(now + gateway.config.batch_window_seconds),
    }
    if errors:
        data = [{"code": e.code, "message": e.message, "param": e.param, "line": e.line or None} for e in errors]
        batch = await batches.store.create_batch(
            "batch_",
            "openai",
            owner(request),
            fields | {"status": "failed", "failed_at": repr(now), "errors": _json(data)},
            [],
        )
        await batches.store.ended(batch.id)
        batch.fields["total"] = str(len(parsed.items))
        return web.json_response(batch_object(batch))
    batch = await batches.store.create_batch(
        "batch_", "openai", owner(request), fields | {"status": "validating"}, parsed.items
    )
    batches.runner.wake()
    return web.json_response(batch_object(batch))


async def retrieve(request: web.Request) -> web.Response:
    return web.json_response(batch_object(await _batch(request)))


async def list_batches(request: web.Request) -> web.Response:
    _, batches = gateway_batches(request)
    found, has_more = await batches.store.batches(
        "openai", owner(request), request.query.get("after"), None, page_limit(request, 20, 100)
    )
    data = [batch_object(batch) for batch in found]
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


async def cancel(request: web.Request) -> web.Response:
    batch = await _batch(request)
    store = gateway_batches(request)[1].store
    status = await store.cancel(batch.id)
    if status not in ("cancelling", "cancelled"):
        raise ApiError(
            409, f"the batch is {status}: only a validating or in-progress batch can be cancelled", code="invalid_state"
        )
    return web.json_response(batch_object(await store.batch(batch.id) or batch))


async def _batch(request: web.Request) -> Batch:
    batch_id = request.match_info["batch_id"]
    batch = await gateway_batches(request)[1].store.owned_batch(batch_id, "openai", owner(request))
    if batch is None:  # also a malformed id, and another key's batch: the same 404
        raise ApiError(404, f"No batch found with id '{batch_id}'", param="batch_id", code="not_found")
    return batch


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
