"""The soak's requests: every kind a client sends, how it is sent and read back into an `Answer`.

Kinds: OpenAI chat streamed and whole, n = 2, tools (a required call), structured output (a JSON
schema); Anthropic messages streamed and whole; a foreign producer that writes the protocol straight
into Redis and reads a reply stream (examples/producer.py's way); a client that hangs up after the
first chunk. All greedy (temperature 0) on the float32 model, so each (kind, prompt) has one right
answer, the reference (bench/soak/ledger.py). Batch jobs are in bench/soak/batches.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgpack
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from bench.soak.answers import Answer, anthropic_body, anthropic_event, openai_body, openai_chunk

MAX_TOKENS = 24
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    }
]


@dataclass(frozen=True)
class Target:
    """Where requests go: the gateway's URL (the same after a restart), Redis for foreign producers."""

    gateway_url: Callable[[], str]
    redis: aioredis.Redis
    model: str
    request_stream: str
    client_timeout_s: float


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def openai_request(prompt: str, *, stream: bool, **extra: Any) -> dict[str, Any]:
    body = {"messages": messages(prompt), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def chat_body(kind: str, prompt: str) -> dict[str, Any]:
    """The chat completion body of an OpenAI kind (the batch items use `openai` bodies too)."""
    if kind == "openai":
        return openai_request(prompt, stream=False, ignore_eos=True)
    if kind == "openai_stream":
        return openai_request(prompt, stream=True, ignore_eos=True)
    if kind == "openai_n2_stream":
        return openai_request(prompt, stream=True, n=2, ignore_eos=True)
    if kind == "openai_tools":
        return openai_request(prompt, stream=False, tools=TOOLS, tool_choice="required", max_tokens=48)
    if kind == "openai_json_stream":
        response_format = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
        return openai_request(prompt, stream=True, response_format=response_format, max_tokens=48)
    raise ValueError(kind)


async def send_openai(session: aiohttp.ClientSession, target: Target, body: dict[str, Any]) -> Answer:
    body = {"model": target.model, **body}
    answer, started = Answer(), time.monotonic()

    async def read(response: aiohttp.ClientResponse) -> None:
        if not body["stream"]:
            openai_body(answer, await response.json())
            return
        async for data in _sse_data(response):
            if answer.complete or answer.error:
                answer.extra_after_end = True
            elif data == "[DONE]":
                answer.complete = True
            elif openai_chunk(answer, json.loads(data)) and answer.ttft is None:
                answer.ttft = time.monotonic() - started

    return await _post(session, f"{target.gateway_url()}/v1/chat/completions", body, target, answer, read)


def anthropic_request(prompt: str, *, stream: bool) -> dict[str, Any]:
    return {"messages": messages(prompt), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}


async def send_anthropic(session: aiohttp.ClientSession, target: Target, body: dict[str, Any]) -> Answer:
    body = {"model": target.model, **body}
    answer, started, blocks = Answer(), time.monotonic(), {}

    async def read(response: aiohttp.ClientResponse) -> None:
        if not body["stream"]:
            anthropic_body(answer, await response.json())
            return
        async for data in _sse_data(response):
            if answer.complete or answer.error:
                answer.extra_after_end = True
            elif anthropic_event(answer, json.loads(data), blocks) and answer.ttft is None:
                answer.ttft = time.monotonic() - started

    headers = {"anthropic-version": "2023-06-01"}
    return await _post(session, f"{target.gateway_url()}/v1/messages", body, target, answer, read, headers)


async def hang_up(session: aiohttp.ClientSession, target: Target, prompt: str) -> Answer:
    """A streamed request whose client goes away after the first chunk: nothing to judge but that the
    system carries on (the ledger counts these apart; the leftovers check finds what they leave)."""
    body = {"model": target.model, **openai_request(prompt, stream=True, ignore_eos=True)}
    answer = Answer()

    async def read(response: aiohttp.ClientResponse) -> None:
        async for _ in _sse_data(response):
            break
        answer.complete = True  # left on purpose

    return await _post(session, f"{target.gateway_url()}/v1/chat/completions", body, target, answer, read)


async def _post(
    session, url, body, target, answer, read: Callable[[aiohttp.ClientResponse], Awaitable[None]], headers=None
):
    try:
        async with asyncio.timeout(target.client_timeout_s):
            async with session.post(url, json=body, headers=headers) as response:
                answer.status = response.status
                if response.status != 200:
                    answer.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                    return answer
                await read(response)
    except TimeoutError:
        answer.hung = True
    except (aiohttp.ClientError, ConnectionError) as exc:
        answer.error = answer.error or f"connection: {type(exc).__name__}: {exc}"[:300]
    except json.JSONDecodeError as exc:
        answer.error = answer.error or f"not JSON: {exc}"
    if not answer.complete and answer.error is None and not answer.hung:
        answer.error = None  # a 200 that ended without its end marker: the ledger calls it wrong
    return answer


async def _sse_data(response: aiohttp.ClientResponse):
    async for line in response.content:
        text = line.decode("utf-8").rstrip("\r\n")
        if text.startswith("data:"):
            yield text[len("data:") :].strip()


# ---------------------------------------------------------------- a foreign producer


async def send_foreign(target: Target, prompt: str, reply_prefix: str = "soak:reply:") -> Answer:
    """A request XADDed as docs/protocol.md describes, its events read from a reply stream of our own
    (which we delete afterwards). Redis faults are retried: the stream is durable. Events are taken as
    docs/protocol.md tells a producer to: one whose `seq` was seen, or a delta below the tokens taken
    (a re-run repeating them), is dropped; a delta past them is a gap, a wrong answer, not an error."""
    request_id = uuid.uuid4().hex
    reply_key = f"{reply_prefix}{request_id}"
    request = {
        "v": 1,
        "id": request_id,
        "model": target.model,
        "reply": {"kind": "stream", "key": reply_key},
        "messages": messages(prompt),
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        "deadline": time.time() + target.client_timeout_s - 5,
    }
    answer, started = Answer(status=0), time.monotonic()
    deadline = started + target.client_timeout_s
    if not await _retrying(lambda: target.redis.xadd(target.request_stream, {"msg": msgpack.packb(request)}), deadline):
        answer.error = "could not enqueue: Redis unreachable"
        return answer
    last_id, last_seq, streamed, got = "0-0", -1, 0, answer.choice(0)
    while time.monotonic() < deadline and not (answer.complete or answer.error):
        reply = await _retrying(lambda: target.redis.xread({reply_key: last_id}, block=1000), deadline)
        for _, entries in reply or []:
            for last_id, fields in entries:  # noqa: B007
                event = msgpack.unpackb(fields[b"msg"])
                if event["seq"] <= last_seq or (event["type"] == "delta" and event["offset"] < streamed):
                    continue  # had it: sent again (at least once), or repeated by a re-run
                last_seq = event["seq"]
                if event["type"] == "delta":
                    if event["offset"] > streamed:
                        got.text += f"<gap: offset {event['offset']} after {streamed}>"
                    streamed = event["offset"] + len(event["token_ids"])
                    got.text += event["text"]
                    if answer.ttft is None and event["text"]:
                        answer.ttft = time.monotonic() - started
                elif event["type"] == "done":
                    got.finish = event["finish_reason"]
                    answer.complete = True
                elif event["type"] == "error":
                    answer.error = f"error event: {event['code']}: {event['message']}"[:300]
    answer.hung = not (answer.complete or answer.error)
    await _retrying(lambda: target.redis.delete(reply_key), time.monotonic() + 10)
    return answer


async def _retrying(call: Callable[[], Awaitable[Any]], deadline: float) -> Any:
    """The call's result, retried while Redis is down, until `deadline` (then None)."""
    while True:
        try:
            return await call()
        except (RedisConnectionError, RedisTimeoutError, OSError):
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.5)
