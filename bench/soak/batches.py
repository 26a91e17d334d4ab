"""The soak's batch jobs: OpenAI batches of chat completions, one after another while the soak runs.

Each job uploads a JSONL input (`POST /v1/files`), creates the batch, polls it to its end through
gateway restarts, and reads its output file: every item's body is judged like a whole `openai`
chat completion of the same prompt (an item the batch reports as failed is a visible error). A
job that does not end before the soak's drain deadline loses its unfinished items.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp

from bench.soak.answers import Answer, openai_body
from bench.soak.traffic import Target, chat_body

ENDED = ("completed", "failed", "cancelled", "expired")
POLL_S = 1.0


async def run_batches(session: aiohttp.ClientSession, target: Target, prompts: list[str], items: int,
                      record: Callable[[int, float, Answer], None], until: Callable[[], bool],
                      drain_deadline: Callable[[], float]) -> None:  # fmt: skip
    """Jobs of `items` items, one after another until `until()`; `record(prompt index, started, answer)` per item."""
    job = 0
    while not until():
        chosen = [(job * items + i) % len(prompts) for i in range(items)]
        started = time.monotonic()
        answers = await _one_job(session, target, [prompts[i] for i in chosen], drain_deadline)
        for index, answer in zip(chosen, answers):
            record(index, started, answer)
        job += 1


async def _one_job(session, target: Target, prompts: list[str], drain_deadline: Callable[[], float]) -> list[Answer]:
    lines = [
        {"custom_id": f"item-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": target.model, **chat_body("openai", prompt)}}
        for i, prompt in enumerate(prompts)
    ]  # fmt: skip
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    try:
        batch = await _until_answered(lambda: _create(session, target, data), drain_deadline)
    except _Refused as exc:
        return [Answer(status=exc.status, error=f"batch not created: {exc}") for _ in prompts]
    if batch is None:
        return [Answer(hung=True) for _ in prompts]
    while batch["status"] not in ENDED:
        await asyncio.sleep(POLL_S)
        polled = await _until_answered(
            lambda: _get_json(session, f"{target.gateway_url()}/v1/batches/{batch['id']}"), drain_deadline
        )
        if polled is None:
            return [Answer(hung=True) for _ in prompts]
        batch = polled
    outputs: dict[str, dict] = {}
    for file_field in ("output_file_id", "error_file_id"):
        if batch.get(file_field):
            url = f"{target.gateway_url()}/v1/files/{batch[file_field]}/content"
            text = await _until_answered(lambda url=url: _get_text(session, url), drain_deadline) or ""
            outputs |= {line["custom_id"]: line for line in map(json.loads, filter(None, text.splitlines()))}
    return [_item_answer(outputs.get(f"item-{i}")) for i in range(len(prompts))]


def _item_answer(line: dict | None) -> Answer:
    answer = Answer()
    if line is None:
        answer.error = "no output line for the item"
        return answer
    response = line.get("response") or {}
    answer.status = response.get("status_code")
    if line.get("error") or answer.status != 200:
        answer.error = f"item failed: {json.dumps(line.get('error') or response.get('body'))[:300]}"
        return answer
    openai_body(answer, response["body"])
    return answer


class _Refused(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text[:200]}")
        self.status = status


async def _until_answered(call, drain_deadline: Callable[[], float]):
    """The call's result, retried through connection errors (a gateway restarting) until the drain deadline."""
    while time.monotonic() < drain_deadline():
        try:
            return await call()
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            await asyncio.sleep(POLL_S)
    return None


async def _create(session: aiohttp.ClientSession, target: Target, data: bytes) -> dict:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="soak.jsonl", content_type="application/jsonl")
    async with session.post(
        f"{target.gateway_url()}/v1/files", data=form, timeout=aiohttp.ClientTimeout(total=30)
    ) as response:
        if response.status >= 500:
            raise aiohttp.ClientError(f"HTTP {response.status}")  # retried
        if response.status != 200:
            raise _Refused(response.status, await response.text())
        file_id = (await response.json())["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    async with session.post(
        f"{target.gateway_url()}/v1/batches", json=body, timeout=aiohttp.ClientTimeout(total=30)
    ) as response:
        if response.status != 200:
            raise _Refused(response.status, await response.text())
        return await response.json()


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
        if response.status != 200:
            raise aiohttp.ClientError(f"HTTP {response.status}")
        return await response.json()


async def _get_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
        if response.status != 200:
            raise aiohttp.ClientError(f"HTTP {response.status}")
        return await response.text()
