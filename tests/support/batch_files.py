"""Helpers for the batch tests: the SDKs' clients, input files and Anthropic requests, creating a
batch, polling one to its end, reading its output files."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import anthropic
import openai

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


def openai_client(url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def anthropic_client(url: str, key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)


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


def message_params(prompt: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    """An Anthropic Message Batches request's `params`: greedy, on the tiny model."""
    return {
        "model": REAL_MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        **extra,
    }


def message_request(custom_id: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    """One request of a message batch, its prompt its custom_id."""
    return {"custom_id": custom_id, "params": message_params(custom_id, max_tokens, **extra)}


def jsonl(lines: list[Any]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def slow(model, step_seconds: float):
    """The tiny model with every step slowed, so a test can act while a batch runs."""
    return dataclasses.replace(model, model=SlowModel(model.model, step_seconds))


async def create_batch(
    client: openai.AsyncOpenAI, lines: list[Any], endpoint: str = "/v1/chat/completions", **options: Any
):
    """Upload `lines` as an input file and create a batch of it (a 24 h window, OpenAI's one)."""
    upload = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return await client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h", **options)


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


async def message_batch_end(client: anthropic.AsyncAnthropic, batch_id: str):
    async def ended():
        batch = await client.messages.batches.retrieve(batch_id)
        return batch if batch.processing_status == "ended" else None

    return await poll(ended, what=f"message batch {batch_id} to end")
