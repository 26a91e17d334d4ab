"""What a finished batch gives back: OpenAI's output and error files, Anthropic's results, as JSONL.

An item's outcome (written once by the runner) is one of `succeeded`, `errored`, `canceled`,
`expired`. OpenAI: succeeded items go to the output file, every other one to the error file,
each line `{id, custom_id, response: {status_code, request_id, body}, error}` (an error the worker
answered is a response with its status and error body; an item that never ran has `response:
null` and `error: {code: batch_cancelled | batch_expired}`). Anthropic: one line per item,
`{custom_id, result: {type, message | error}}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from . import items
from .store import CHUNK, Batch, BatchStore

NEVER_RAN = {
    "canceled": ("batch_cancelled", "the batch was cancelled before this request finished"),
    "expired": ("batch_expired", "the batch's completion window ended before this request finished"),
}


def _line(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


async def _pairs(store: BatchStore, batch: Batch) -> AsyncIterator[tuple[int, dict[str, Any], dict[str, Any]]]:
    """(index, item, outcome) of every item that has an outcome, in input order."""
    pending: list[tuple[int, dict[str, Any]]] = []
    async for index, outcome in store.results(batch.id, batch.total):
        if outcome is not None:
            pending.append((index, outcome))
        if len(pending) >= CHUNK or (index == batch.total - 1 and pending):
            first = pending[0][0]
            chunk_items = await store.items(batch.id, first, pending[-1][0] - first + 1)
            for at, found in pending:
                yield at, chunk_items[at - first], found
            pending = []


async def openai_lines(store: BatchStore, batch: Batch) -> AsyncIterator[tuple[bool, bytes]]:
    """(succeeded, JSONL line) of every item."""
    async for index, item, outcome in _pairs(store, batch):
        line = {
            "id": f"batch_req_{batch.id.removeprefix('batch_')}_{index}",
            "custom_id": item["custom_id"],
            "response": None,
            "error": None,
        }
        kind = outcome["outcome"]
        if kind == "succeeded":
            line["response"] = {
                "status_code": 200,
                "request_id": outcome["request_id"],
                "body": await items.answer_body(item, outcome),
            }
        elif kind == "errored":
            line["response"] = {
                "status_code": items.error_status(outcome),
                "request_id": outcome.get("request_id"),
                "body": items.openai_error(outcome),
            }
        else:
            code, message = NEVER_RAN[kind]
            line["error"] = {"code": code, "message": message}
        yield kind == "succeeded", _line(line)


async def anthropic_results(store: BatchStore, batch: Batch, thinking_secret: str) -> AsyncIterator[bytes]:
    """One line per item; `thinking_secret` signs a thinking model's thinking blocks, as live."""
    async for _, item, outcome in _pairs(store, batch):
        kind = outcome["outcome"]
        result: dict[str, Any] = {"type": kind}
        if kind == "succeeded":
            result["message"] = await items.answer_body(item, outcome, thinking_secret)
        elif kind == "errored":
            result["error"] = items.anthropic_error(outcome)
        yield _line({"custom_id": item["custom_id"], "result": result})
