"""Anthropic's API: POST /v1/messages (whole or as named SSE events) and /v1/messages/count_tokens."""

from __future__ import annotations

from typing import Any

from aiohttp import web

import protocol
from protocol.messages import MAX_TOKENS_LIMIT

from . import sse
from .context import gateway_of
from .errors import anthropic_error_body
from .generation import Delta, Done, Generation, Usage, new_request, new_request_id
from .validate import (
    chat_message,
    invalid,
    optional_bool,
    optional_int,
    optional_number,
    read_json_object,
    required_str,
    sampling_params,
    string_list,
    text_content,
)

ROLES = ("user", "assistant")

# ---------------------------------------------------------------- request bodies


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """`system` (a string or text blocks) and `messages` as protocol chat messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of messages")
    parsed = []
    if body.get("system") is not None:
        parsed.append({"role": "system", "content": text_content(body["system"], "system")})
    return parsed + [chat_message(message, f"messages.{i}", ROLES) for i, message in enumerate(messages)]


def parse_sampling(body: dict[str, Any]) -> protocol.SamplingParams:
    max_tokens = optional_int(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    if max_tokens is None:
        raise invalid("max_tokens", "is required")
    stop = body.get("stop_sequences")
    if stop is not None and not isinstance(stop, list):
        raise invalid("stop_sequences", "must be a list of strings")
    return sampling_params(
        {
            "max_tokens": max_tokens,
            "temperature": optional_number(body, "temperature", 0.0, 1.0),
            "top_p": optional_number(body, "top_p", 0.0, 1.0),
            "top_k": optional_int(body, "top_k", 0, 1 << 20),
            "stop": string_list(stop, "stop_sequences"),
        }
    )


# ---------------------------------------------------------------- response bodies


def stop_reason(done: Done) -> str:
    if done.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if done.stop_sequence else "end_turn"


def usage_body(usage: Usage) -> dict[str, int]:
    # Anthropic counts cache reads apart from input_tokens: the prompt is their sum
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def message_body(message_id: str, model: str, content: list[dict[str, Any]], done: Done | None) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(done) if done else None,
        "stop_sequence": done.stop_sequence if done else None,
        "usage": usage_body(done.usage) if done else {"input_tokens": 0, "output_tokens": 0},
    }


# ---------------------------------------------------------------- handlers


async def messages(request: web.Request) -> web.StreamResponse:
    gateway = gateway_of(request)
    body = await read_json_object(request)
    model = await gateway.models.require(required_str(body, "model"))
    sampling = parse_sampling(body)
    stream = bool(optional_bool(body, "stream"))
    work = new_request(gateway, new_request_id("msg_"), model, sampling, messages=parse_messages(body))
    async with Generation(gateway, work, "messages") as generation:
        if not stream:
            text, done = await generation.result()
            return web.json_response(message_body(work.id, model, [{"type": "text", "text": text}], done))
        keepalive = gateway.config.keepalive_seconds
        return await sse.relay_in_stream(
            request, lambda response: relay(response, generation, work, keepalive), anthropic_error_body, gateway.metrics.errors, "error"
        )


async def relay(response: web.StreamResponse, generation: Generation, work: protocol.Request, keepalive: float) -> None:
    async def send(data: dict[str, Any]) -> None:
        await sse.send(response, data, event=data["type"])

    await send({"type": "message_start", "message": message_body(work.id, work.model, [], None)})
    await send({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    await send({"type": "ping"})
    async for event in generation.events(keepalive):
        if event is None:
            await send({"type": "ping"})
        elif isinstance(event, Delta):
            if event.text:
                await send({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": event.text}})
        else:
            await send({"type": "content_block_stop", "index": 0})
            delta = {"stop_reason": stop_reason(event), "stop_sequence": event.stop_sequence}
            await send({"type": "message_delta", "delta": delta, "usage": usage_body(event.usage)})
            await send({"type": "message_stop"})


async def count_tokens(request: web.Request) -> web.Response:
    """Asks a worker, the one that knows the model's tokenizer and chat template: a one-token greedy
    request whose `done` reports the prompt's length. Its prompt pages stay in the worker's prefix
    cache, so the request that usually follows a count reads them back instead of recomputing them."""
    gateway = gateway_of(request)
    body = await read_json_object(request)
    model = await gateway.models.require(required_str(body, "model"))
    one_token = protocol.SamplingParams(max_tokens=1, temperature=0.0)
    work = new_request(gateway, new_request_id("count_"), model, one_token, messages=parse_messages(body))
    async with Generation(gateway, work, "count_tokens", timed=False) as generation:
        _, done = await generation.result()
    return web.json_response({"input_tokens": done.usage.prompt_tokens})
