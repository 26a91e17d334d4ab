"""OpenAI's API: POST /v1/chat/completions and the legacy POST /v1/completions, streaming or not.

A request reads top to bottom: check its parameters (one lmq does not implement is a 400 naming it),
turn it into protocol requests (one per choice), wait for a worker to admit them (so a refusal is
answered with its HTTP status before any reply), then relay the answer whole or as chunks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

import protocol
from protocol.messages import MAX_LOGPROBS, MAX_TOKENS_LIMIT, ROLES

from . import sse, tool_calls
from .choices import Choices, choice_requests, total_usage
from .config import GatewayConfig
from .context import gateway_of
from .errors import openai_error_body
from .generation import Delta, Done, new_request, new_request_id
from .openai_shapes import ChatShape, CompletionShape, finish_reason
from .tool_calls import ToolCallReader, ToolPlan
from .validate import (
    invalid,
    optional_bool,
    optional_int,
    optional_number,
    optional_object,
    read_json_object,
    refuse_unknown,
    required_str,
    sampling_params,
    string_list,
    text_content,
)

MAX_N = 16
MAX_PROMPTS = 64  # a legacy completion's list of prompts
MAX_CHOICES = 64  # prompts × n: each is a request in the queue

SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
)
EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "ignore_eos")  # vLLM's names, beyond OpenAI's
IGNORED = (
    "user",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "store",
)  # hints with no effect on the answer
CHAT_PARAMS = {"model", "messages", "stream", "stream_options", "max_completion_tokens", "logprobs", "top_logprobs",
               "response_format", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort",
               "chat_template_kwargs", *SAMPLING, *EXTENSIONS, *IGNORED}  # fmt: skip
COMPLETION_PARAMS = {
    "model",
    "prompt",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "best_of",
    *SAMPLING,
    *EXTENSIONS,
    *IGNORED,
}

# The thinking budget (tokens) each `reasoning_effort` means; "none" turns thinking off.
REASONING_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384}

# ---------------------------------------------------------------- request bodies


@dataclass(frozen=True)
class Streaming:
    enabled: bool
    include_usage: bool


def parse_sampling(body: dict[str, Any], config: GatewayConfig) -> protocol.SamplingParams:
    max_tokens = optional_int(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT) or optional_int(
        body, "max_tokens", 1, MAX_TOKENS_LIMIT
    )
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
            "logit_bias": optional_object(body, "logit_bias"),
            "stop": string_list(body.get("stop"), "stop"),
            "ignore_eos": optional_bool(body, "ignore_eos"),
        },
        config.sampling_default_fields,
    )


def parse_n(body: dict[str, Any]) -> int:
    return optional_int(body, "n", 1, MAX_N) or 1


def parse_streaming(body: dict[str, Any]) -> Streaming:
    options = optional_object(body, "stream_options")
    include_usage = optional_bool(options, "include_usage")
    return Streaming(enabled=bool(optional_bool(body, "stream")), include_usage=bool(include_usage))


def parse_chat_logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives to report per token (0-20), or None for no logprobs."""
    top = optional_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not optional_bool(body, "logprobs"):
        if top is not None:
            raise invalid("top_logprobs", "needs `logprobs: true`")
        return None
    return top or 0


def parse_completion_logprobs(body: dict[str, Any]) -> int | None:
    return optional_int(body, "logprobs", 0, MAX_LOGPROBS)


def parse_response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`response_format` as a protocol constraint: json_object, or json_schema (always enforced, strict or not)."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema", "must be a JSON Schema object")
        return {"type": "json_schema", "schema": schema}
    raise invalid("response_format.type", 'must be "text", "json_object" or "json_schema"')


def parse_reasoning(body: dict[str, Any]) -> dict[str, Any]:
    """`reasoning_effort` and `chat_template_kwargs` as protocol fields. The template decides whether a
    model thinks; an effort is a budget the worker enforces (REASONING_BUDGETS), and "none" also tells
    the template not to think (`enable_thinking: false`, which Qwen3's reads) with a budget of 0, so a
    template that always opens the block (QwQ, R1) has it closed at once."""
    template_kwargs = optional_object(body, "chat_template_kwargs") or None
    effort = body.get("reasoning_effort")
    if effort is None:
        return {"template_kwargs": template_kwargs}
    if effort == "none":
        return {"template_kwargs": {"enable_thinking": False, **(template_kwargs or {})}, "reasoning_budget": 0}
    if effort not in REASONING_BUDGETS:
        raise invalid("reasoning_effort", f'must be "none" or one of {", ".join(REASONING_BUDGETS)}')
    return {"template_kwargs": template_kwargs, "reasoning_budget": REASONING_BUDGETS[effort]}


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of messages")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise invalid(where, "must be an object with `role` and `content`")
    role = message.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}")
    parsed: dict[str, Any] = {"role": role, "content": text_content(message.get("content"), f"{where}.content")}
    if role == "assistant" and message.get("tool_calls"):
        parsed["tool_calls"] = [
            _tool_call(call, f"{where}.tool_calls[{i}]")
            for i, call in enumerate(_list(message["tool_calls"], f"{where}.tool_calls"))
        ]
    if role == "tool":
        parsed["tool_call_id"] = required_str(message, "tool_call_id") if "tool_call_id" in message else ""
    if isinstance(message.get("name"), str):
        parsed["name"] = message["name"]
    return parsed


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {
        "id": str(call.get("id", "")),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise invalid(where, "must be a list")
    return value


def parse_prompts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The legacy `prompt`: a string, token ids, or a list of either (one answer each); as Request keyword arguments."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(item, int) for item in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise invalid("prompt", f"at most {MAX_PROMPTS} prompts in one request")
        return [_one_prompt(item, f"prompt[{index}]") for index, item in enumerate(prompt)]
    return [_one_prompt(prompt, "prompt")]


def parse_prompt(body: dict[str, Any]) -> dict[str, Any]:
    """A legacy `prompt` that must be one prompt (a batch item's)."""
    prompts = parse_prompts(body)
    if len(prompts) > 1:
        raise invalid("prompt", "must be one prompt here (a string or a list of token ids)")
    return prompts[0]


def _one_prompt(prompt: Any, where: str) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt)
    ):
        return {"prompt_ids": prompt}
    raise invalid(where, "must be a string or a list of token ids, or a list of those")


def refuse_unsupported_completion_options(body: dict[str, Any]) -> None:
    if optional_bool(body, "echo"):
        raise invalid("echo", "echo is not supported")
    if optional_int(body, "best_of", 1, 128) not in (None, 1, parse_n(body)):
        raise invalid("best_of", "best_of must equal n (choosing the best of more is not supported)")


def refuse_storing(body: dict[str, Any]) -> None:
    if optional_bool(body, "store"):
        raise invalid("store", "stored completions are not supported; leave `store` out or false")


# ---------------------------------------------------------------- handlers


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gateway = gateway_of(request)
    body = await read_json_object(request)
    refuse_unknown(body, CHAT_PARAMS)
    refuse_storing(body)
    model = await gateway.models.require(required_str(body, "model"))
    n, sampling, streaming = parse_n(body), parse_sampling(body, gateway.config), parse_streaming(body)
    top_logprobs = parse_chat_logprobs(body)
    plan = tool_calls.openai_plan(body)
    constraint = plan.constraint or parse_response_format(body)
    request_id = new_request_id("chatcmpl-")
    work = new_request(
        gateway, request_id, model, sampling,
        messages=parse_messages(body), tools=plan.tools, constraint=constraint, logprobs=top_logprobs,
        **parse_reasoning(body),
    )  # fmt: skip
    shape = ChatShape(request_id, model, streaming.include_usage, top_logprobs)
    async with Choices(gateway, choice_requests([work], n), shape.api) as choices:
        if not streaming.enabled:
            return web.json_response(await complete_chat(choices, shape, plan))
        await choices.admitted(gateway.config.admission_wait)
        keepalive = gateway.config.keepalive_seconds
        return await sse.relay_in_stream(
            request,
            lambda response: relay_chat(response, choices, shape, plan, keepalive),
            openai_error_body,
            gateway.metrics.errors,
        )


async def completions(request: web.Request) -> web.StreamResponse:
    gateway = gateway_of(request)
    body = await read_json_object(request)
    refuse_unknown(body, COMPLETION_PARAMS)
    refuse_storing(body)
    model = await gateway.models.require(required_str(body, "model"))
    refuse_unsupported_completion_options(body)
    n, sampling, streaming = parse_n(body), parse_sampling(body, gateway.config), parse_streaming(body)
    top_logprobs = parse_completion_logprobs(body)
    request_id, prompts = new_request_id("cmpl-"), parse_prompts(body)
    if len(prompts) * n > MAX_CHOICES:
        raise invalid("n", f"prompts × n is at most {MAX_CHOICES} (here {len(prompts)} × {n})")
    works = [new_request(gateway, request_id, model, sampling, logprobs=top_logprobs, **prompt) for prompt in prompts]
    shape = CompletionShape(request_id, model, streaming.include_usage, top_logprobs)
    async with Choices(gateway, choice_requests(works, n), shape.api) as choices:
        if not streaming.enabled:
            results = await choices.results()
            body = shape.complete(
                [(text, logprobs, done.finish_reason) for text, logprobs, done in results],
                total_usage([r[2] for r in results], n),
            )
            return web.json_response(body)
        await choices.admitted(gateway.config.admission_wait)
        keepalive = gateway.config.keepalive_seconds
        return await sse.relay_in_stream(
            request,
            lambda response: relay_completion(response, choices, shape, n, keepalive),
            openai_error_body,
            gateway.metrics.errors,
        )


async def complete_chat(choices: Choices, shape: ChatShape, plan: ToolPlan) -> dict[str, Any]:
    results = await choices.results()
    bodies = []
    for text, logprobs, done in results:
        reader = ToolCallReader(plan)
        content = reader.feed(text).text + reader.finish().text
        bodies.append((content, logprobs, reader.calls, finish_reason(done, reader.calls), done.reasoning))
    return shape.complete(bodies, total_usage([done for _, _, done in results], len(results)))


async def relay_chat(
    response: web.StreamResponse, choices: Choices, shape: ChatShape, plan: ToolPlan, keepalive: float
) -> None:
    readers = [ToolCallReader(plan) for _ in choices.generations]
    dones = []
    for index in range(len(readers)):
        await sse.send(response, shape.first_chunk(index))
    async for item in choices.events(keepalive):
        if item is None:
            await sse.send_comment(response, "waiting")
            continue
        index, event = item
        reader = readers[index]
        if isinstance(event, Delta):
            for chunk in shape.piece_chunks(index, reader.feed(event.text), event.logprobs, event.reasoning):
                await sse.send(response, chunk)
            continue
        for chunk in shape.piece_chunks(index, reader.finish(), None):
            await sse.send(response, chunk)
        await sse.send(response, shape.finish_chunk(index, finish_reason(event, reader.calls)))
        dones.append(event)
    if shape.include_usage:
        await sse.send(response, shape.usage_chunk(total_usage(dones, len(dones))))
    await sse.send(response, "[DONE]")


async def relay_completion(
    response: web.StreamResponse, choices: Choices, shape: CompletionShape, n: int, keepalive: float
) -> None:
    offsets = [0] * len(choices.generations)
    dones: dict[int, Done] = {}
    async for item in choices.events(keepalive):
        if item is None:
            await sse.send_comment(response, "waiting")
            continue
        index, event = item
        if isinstance(event, Delta):
            if event.text or event.logprobs:
                await sse.send(response, shape.text_chunk(index, event.text, event.logprobs, offsets[index]))
                offsets[index] += len(event.text)
            continue
        await sse.send(response, shape.finish_chunk(index, event.finish_reason))
        dones[index] = event
    if shape.include_usage:
        await sse.send(response, shape.usage_chunk(total_usage([dones[index] for index in sorted(dones)], n)))
    await sse.send(response, "[DONE]")
