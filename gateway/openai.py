"""OpenAI's API: POST /v1/chat/completions and the legacy POST /v1/completions, streaming or not."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

import protocol
from protocol.messages import MAX_TOKENS_LIMIT, ROLES

from . import sse
from .config import GatewayConfig
from .context import Gateway, gateway_of
from .errors import openai_error_body
from .generation import Delta, Done, Generation, Usage, new_request, new_request_id
from .validate import (
    chat_message,
    invalid,
    optional_bool,
    optional_int,
    optional_number,
    optional_object,
    read_json_object,
    required_str,
    sampling_params,
    string_list,
)

# ---------------------------------------------------------------- request bodies


@dataclass(frozen=True)
class Streaming:
    enabled: bool
    include_usage: bool


def parse_sampling(body: dict[str, Any], config: GatewayConfig) -> protocol.SamplingParams:
    n = optional_int(body, "n", 1, 128)
    if n not in (None, 1):
        raise invalid("n", "only n=1 is supported")
    max_tokens = optional_int(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT) or optional_int(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    logit_bias = optional_object(body, "logit_bias")
    if not isinstance(body.get("user", ""), str):
        raise invalid("user", "must be a string")
    return sampling_params(
        {
            "max_tokens": max_tokens or config.default_max_tokens,
            "temperature": optional_number(body, "temperature", 0.0, 2.0),
            "top_p": optional_number(body, "top_p", 0.0, 1.0),
            "top_k": optional_int(body, "top_k", 0, 1 << 20),
            "min_p": optional_number(body, "min_p", 0.0, 1.0),
            "seed": optional_int(body, "seed", -(1 << 63), (1 << 64) - 1),
            "presence_penalty": optional_number(body, "presence_penalty", -2.0, 2.0),
            "frequency_penalty": optional_number(body, "frequency_penalty", -2.0, 2.0),
            "repetition_penalty": optional_number(body, "repetition_penalty", 0.01, 10.0),
            "logit_bias": logit_bias,
            "stop": string_list(body.get("stop"), "stop"),
            "ignore_eos": optional_bool(body, "ignore_eos"),
        }
    )


def parse_streaming(body: dict[str, Any]) -> Streaming:
    options = optional_object(body, "stream_options")
    include_usage = optional_bool(options, "include_usage")
    return Streaming(enabled=bool(optional_bool(body, "stream")), include_usage=bool(include_usage))


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of messages")
    return [chat_message(message, f"messages[{i}]", ROLES) for i, message in enumerate(messages)]


def parse_prompt(body: dict[str, Any]) -> dict[str, Any]:
    """The legacy `prompt`: a string or token ids, alone or as a list of one; as Request keyword arguments."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt):
        return {"prompt_ids": prompt}
    raise invalid("prompt", "must be a string or a list of token ids (one prompt per request)")


def refuse_unsupported_completion_options(body: dict[str, Any]) -> None:
    if optional_bool(body, "echo"):
        raise invalid("echo", "echo is not supported")
    if optional_int(body, "best_of", 1, 128) not in (None, 1):
        raise invalid("best_of", "only best_of=1 is supported")


# ---------------------------------------------------------------- response bodies


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class _Shape:
    """What both endpoints' bodies share: id, created and model on every chunk, and usage only when asked."""

    chunk_object: str  # the `object` of a streamed chunk

    def __init__(self, request_id: str, model: str, include_usage: bool = False):
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._envelope(self.chunk_object, []) | {"usage": usage_body(usage)}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object, [choice])
        return chunk | {"usage": None} if self.include_usage else chunk

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "system_fingerprint": None, "choices": choices}


class ChatShape(_Shape):
    """Bodies of /v1/chat/completions: one `chat.completion`, or `chat.completion.chunk`s."""

    chunk_object = "chat.completion.chunk"
    api = "chat_completions"  # in metrics

    def complete(self, text: str, done: Done) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}, "logprobs": None, "finish_reason": done.finish_reason}
        return self._envelope("chat.completion", [choice]) | {"usage": usage_body(done.usage)}

    def first_chunk(self) -> dict[str, Any]:
        return self._chunk(self._delta({"role": "assistant", "content": ""}, None))

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk(self._delta({"content": text}, None))

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk(self._delta({}, finish_reason))

    @staticmethod
    def _delta(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


class CompletionShape(_Shape):
    """Bodies of the legacy /v1/completions: `text_completion` objects, whole or in chunks."""

    chunk_object = "text_completion"
    api = "completions"

    def complete(self, text: str, done: Done) -> dict[str, Any]:
        return self._envelope("text_completion", [self._choice(text, done.finish_reason)]) | {"usage": usage_body(done.usage)}

    def first_chunk(self) -> None:
        return None  # legacy chunks carry no role

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk(self._choice(text, None))

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk(self._choice("", finish_reason))

    @staticmethod
    def _choice(text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


# ---------------------------------------------------------------- handlers


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gateway = gateway_of(request)
    body = await read_json_object(request)
    model = await gateway.models.require(required_str(body, "model"))
    sampling = parse_sampling(body, gateway.config)
    streaming = parse_streaming(body)
    work = new_request(gateway, new_request_id("chatcmpl-"), model, sampling, messages=parse_messages(body))
    return await answer(request, gateway, work, ChatShape(work.id, model, streaming.include_usage), streaming.enabled)


async def completions(request: web.Request) -> web.StreamResponse:
    gateway = gateway_of(request)
    body = await read_json_object(request)
    model = await gateway.models.require(required_str(body, "model"))
    refuse_unsupported_completion_options(body)
    sampling = parse_sampling(body, gateway.config)
    streaming = parse_streaming(body)
    work = new_request(gateway, new_request_id("cmpl-"), model, sampling, **parse_prompt(body))
    return await answer(request, gateway, work, CompletionShape(work.id, model, streaming.include_usage), streaming.enabled)


async def answer(request: web.Request, gateway: Gateway, work: protocol.Request, shape: ChatShape | CompletionShape, stream: bool) -> web.StreamResponse:
    async with Generation(gateway, work, shape.api) as generation:
        if not stream:
            text, done = await generation.result()
            return web.json_response(shape.complete(text, done))
        keepalive = gateway.config.keepalive_seconds
        return await sse.relay_in_stream(
            request, lambda response: relay(response, generation, shape, keepalive), openai_error_body, gateway.metrics.errors
        )


async def relay(response: web.StreamResponse, generation: Generation, shape: ChatShape | CompletionShape, keepalive: float) -> None:
    first = shape.first_chunk()
    if first is not None:
        await sse.send(response, first)
    async for event in generation.events(keepalive):
        if event is None:
            await sse.send_comment(response, "waiting")
        elif isinstance(event, Delta):
            if event.text:
                await sse.send(response, shape.text_chunk(event.text))
        else:
            await sse.send(response, shape.finish_chunk(event.finish_reason))
            if shape.include_usage:
                await sse.send(response, shape.usage_chunk(event.usage))
    await sse.send(response, "[DONE]")
