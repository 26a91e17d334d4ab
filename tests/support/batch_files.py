"""Helpers for the batch tests: input files, polling a batch to its end, reading its output files."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

from tests.support.gateway_harness import REAL_MODEL
from tests.support.worker_harness import TIMEOUT_S
from tests.support.worker_process import SlowModel

ENDED = ("completed", "failed", "cancelled", "expired")


async def poll(check, *, what: str, timeout: float = TIMEOUT_S, interval: float = 0.2):
    """Call an async check every `interval` s until it returns something true; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await check()
        if result:
            return result
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def chat_line(custom_id: str, prompt: str, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": REAL_MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **body,
        },
    }


def jsonl(lines: list[Any]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def slow(model, step_seconds: float):
    """The tiny model with every step slowed, so a test can act while a batch runs."""
    return dataclasses.replace(model, model=SlowModel(model.model, step_seconds))


async def openai_batch_end(client, batch_id: str, timeout: float = 120.0):
    async def ended():
        batch = await client.batches.retrieve(batch_id)
        return batch if batch.status in ENDED else None

    return await poll(ended, what=f"batch {batch_id} to end", timeout=timeout)


async def file_lines(client, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines() if line.strip()]


async def openai_progress(client, batch_id: str, finished: int):
    """Wait until at least `finished` items have an outcome."""

    async def far_enough():
        batch = await client.batches.retrieve(batch_id)
        counts = batch.request_counts
        return batch if counts.completed + counts.failed >= finished else None

    return await poll(far_enough, what=f"{finished} items of {batch_id} to finish")
