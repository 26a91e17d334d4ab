"""Anthropic's API: POST /v1/messages (whole or as named SSE events) and /v1/messages/count_tokens.

Content blocks map onto chat messages: `tool_use` blocks become an assistant's tool calls,
`tool_result` blocks tool messages; a conversation that ends with the assistant's text is that
answer's beginning (a prefill), continued rather than closed.

Thinking (a thinking model's, gateway/reasoning.py) is off unless the request enables it, as on
Anthropic's API: `{"type": "enabled", "budget_tokens": N}` lets the template think and the worker
close the thinking after N tokens; the answer then opens with a `thinking` block (streamed as
thinking_delta, then a signature_delta) signed by the gateway (gateway/thinking_signature.py).
A thinking block sent back in the history must carry its signature; it is checked and left out of
the prompt (the templates drop earlier turns' thinking too).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

import protocol
from protocol.messages import MAX_TOKENS_LIMIT

from . import sse, thinking_signature, tool_calls
from .choices import Choices
from .context import Gateway, gateway_of
from .errors import anthropic_error_body
from .generation import Delta, Done, Generation, Usage, new_request, new_request_id
from .tool_calls import Piece, ToolCall, ToolCallReader, ToolPlan
from .validate import (
    invalid,
    optional_bool,
    optional_int,
    optional_number,
    read_json_object,
    refuse_unknown,
    required_str,
    sampling_params,
    string_list,
    text_content,
)

ROLES = ("user", "assistant")
# Hints with no effect on the answer here: accepted and ignored (docs/api.md says so).
HINTS = {
    "metadata",
    "service_tier",
    "cache_control",
    "speed",
    "inference_geo",
    "user_profile_id",
    "workspace_id",
    "diagnostics",
}
MESSAGES_PARAMS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
                   "min_p", "ignore_eos", "tools", "tool_choice", "thinking", "output_config", *HINTS}  # fmt: skip
COUNT_PARAMS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", *HINTS}

# ---------------------------------------------------------------- request bodies


def parse_messages(body: dict[str, Any], secret: str) -> list[dict[str, Any]]:
    """`system` (a string or text blocks) and `messages` as protocol chat messages; `secret` checks the
    signatures of thinking blocks."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of messages")
    parsed = []
    if body.get("system") is not None:
        parsed.append({"role": "system", "content": text_content(body["system"], "system")})
    for i, message in enumerate(messages):
        parsed += _chat_messages(message, f"messages.{i}", secret)
    return parsed


def _chat_messages(message: Any, where: str, secret: str) -> list[dict[str, Any]]:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise invalid(f"{where}.role", "must be one of user, assistant")
    role, content = message["role"], message.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise invalid(f"{where}.content", "must be a string or a list of content blocks")
    texts, calls, results = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and role == "assistant":
            _check_signature(block, at, secret)  # verified, then left out: earlier thinking is not shown
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": str(block.get("tool_use_id", "")),
                    "content": text_content(block.get("content"), f"{at}.content"),
                }
            )
        else:
            raise invalid(
                at,
                "only text blocks, an assistant's thinking and tool_use and a user's tool_result blocks are supported",
            )
    text = "\n".join(texts)
    if role == "assistant":
        return [{"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})]
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _check_signature(block: dict[str, Any], where: str, secret: str) -> None:
    if not isinstance(block.get("thinking"), str):
        raise invalid(f"{where}.thinking", "must be the thinking's text")
    if not thinking_signature.verify(secret, block["thinking"], block.get("signature")):
        raise invalid(f"{where}.signature", "does not match the thinking: not a block this service wrote, or changed")


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
        raise invalid(where, "a tool_use block needs `name` and an `input` object")
    return {
        "id": str(block.get("id", "")),
        "type": "function",
        "function": {"name": block["name"], "arguments": block.get("input", {})},
    }


def continues_answer(messages: list[dict[str, Any]]) -> bool:
    """A conversation ending with the assistant's own text asks to continue that text."""
    last = messages[-1]
    return last["role"] == "assistant" and not last.get("tool_calls")


def parse_thinking(body: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """`thinking` as protocol fields. Disabled (the default) tells the template not to think
    (`enable_thinking: false`, Qwen3's switch) and gives a budget of 0, which closes at once the block
    of a template that always opens one (QwQ, R1); enabled lets it think for up to `budget_tokens`
    tokens, fewer than max_tokens as Anthropic requires. A model that does not think answers as usual."""
    thinking = body.get("thinking")
    if thinking is None or thinking == {"type": "disabled"}:
        return {"template_kwargs": {"enable_thinking": False}, "reasoning_budget": 0}
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled" or set(thinking) - {"type", "budget_tokens"}:
        raise invalid("thinking", 'must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}')
    most = MAX_TOKENS_LIMIT if max_tokens is None else max_tokens - 1
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= most:
        raise invalid("thinking.budget_tokens", f"must be an integer from 1 to max_tokens - 1 ({most})")
    return {"template_kwargs": {"enable_thinking": True}, "reasoning_budget": budget}


def parse_output_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`output_config.format` (structured outputs) as a protocol constraint; `effort` is a hint, ignored."""
    config = body.get("output_config")
    if config is None:
        return None
    if not isinstance(config, dict) or set(config) - {"format", "effort"}:
        raise invalid("output_config", "only `format` (and the hint `effort`) are supported")
    spec = config.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise invalid("output_config.format", 'must be {"type": "json_schema", "schema": {...}}')
    return {"type": "json_schema", "schema": spec["schema"]}


def parse_sampling(body: dict[str, Any], defaults: dict[str, Any]) -> protocol.SamplingParams:
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
            "min_p": optional_number(body, "min_p", 0.0, 1.0),
            "stop": string_list(stop, "stop_sequences"),
            "ignore_eos": optional_bool(body, "ignore_eos"),
        },
        defaults,
    )


# ---------------------------------------------------------------- response bodies


def stop_reason(done: Done, calls: list[ToolCall], forced: bool = False) -> str:
    """`forced`: a forced tool choice's turn with a complete call ends with it (tool_use) even where
    the output ran on to max_tokens."""
    if done.finish_reason == "length" and not (forced and calls):
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if done.stop_sequence else "end_turn"


def usage_body(usage: Usage) -> dict[str, int]:
    # Anthropic counts cache reads apart from input_tokens: the prompt is their sum
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def thinking_block(secret: str, thinking: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking, "signature": thinking_signature.sign(secret, thinking)}


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:  # cut off by max_tokens
        arguments = {}
    return {
        "type": "tool_use",
        "id": call.id,
        "name": call.name,
        "input": arguments if isinstance(arguments, dict) else {},
    }


def message_body(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    done: Done | None,
    calls: list[ToolCall],
    prompt_tokens: int = 0,
    forced: bool = False,
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(done, calls, forced) if done else None,
        "stop_sequence": done.stop_sequence if done else None,
        "usage": usage_body(done.usage) if done else {"input_tokens": prompt_tokens, "output_tokens": 0},
    }


def message_request(
    gateway: Gateway, body: dict[str, Any], model: str, request_id: str
) -> tuple[protocol.Request, ToolPlan]:
    """The protocol request a messages body asks for, and its tool plan: what the live handler sends,
    and what a batch item sends (gateway/batches/items.py). Raises ApiError naming a bad parameter."""
    sampling = parse_sampling(body, gateway.config.sampling_default_fields)
    thinking = parse_thinking(body, sampling.max_tokens)
    plan = tool_calls.anthropic_plan(body)
    chat = parse_messages(body, gateway.config.thinking_secret)
    work = new_request(
        gateway, request_id, model, sampling,
        messages=chat, tools=plan.tools, constraint=plan.constraint or parse_output_format(body), continue_final=continues_answer(chat),
        **thinking,
    )  # fmt: skip
    return work, plan


def complete_message(request_id: str, model: str, text: str, done: Done, plan: ToolPlan, secret: str) -> dict[str, Any]:
    """A finished answer as the message body: the thinking (a thinking model's, signed with `secret`)
    first, then the text, then the tool calls read from it. The live handler's and a batch item's."""
    reader = ToolCallReader(plan, "toolu_")
    content_text = reader.feed(text).text + reader.finish().text
    content = [thinking_block(secret, done.reasoning)] if done.reasoning else []
    content += [{"type": "text", "text": content_text}] if content_text.strip() or not reader.calls else []
    content += [tool_use_block(call) for call in reader.calls]
    return message_body(request_id, model, content, done, reader.calls, forced=reader.forced_done)


# ---------------------------------------------------------------- handlers


async def messages(request: web.Request) -> web.StreamResponse:
    gateway = gateway_of(request)
    body = await read_json_object(request)
    refuse_unknown(body, MESSAGES_PARAMS)
    model = await gateway.models.require(required_str(body, "model"))
    request_id = new_request_id("msg_")
    work, plan = message_request(gateway, body, model, request_id)
    stream = bool(optional_bool(body, "stream"))
    secret = gateway.config.thinking_secret
    async with Choices(gateway, [work], "messages") as choices:
        if not stream:
            [(text, _, done)] = await choices.results()
            return web.json_response(complete_message(request_id, model, text, done, plan, secret))
        await choices.admitted(gateway.config.admission_wait)
        keepalive = gateway.config.keepalive_seconds
        return await sse.relay_in_stream(
            request,
            lambda response: relay(response, choices, request_id, work, plan, keepalive, secret),
            anthropic_error_body,
            gateway.metrics.errors,
            "error",
        )


class _Blocks:
    """The content blocks of a streamed message, opened as their content arrives and closed in order."""

    def __init__(self, response: web.StreamResponse, secret: str = ""):
        self.response = response
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or "tool_use"
        self._blank = ""  # whitespace that opens no text block (yet): it may precede a tool call
        self._secret = secret
        self._thinking: list[str] = []  # the open thinking block's text, signed when it closes

    async def send(self, data: dict[str, Any]) -> None:
        await sse.send(self.response, data, event=data["type"])

    async def piece(self, piece: Piece) -> None:
        text = piece.text
        if text and self.open != "text" and not text.strip():
            self._blank += text
        elif text:
            await self.open_text()
            text, self._blank = self._blank + text, ""
            await self.send(
                {"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": text}}
            )
        for call in piece.started:
            await self._open("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}, new=True)
        for _, arguments in piece.arguments:
            if arguments:
                await self.send(
                    {
                        "type": "content_block_delta",
                        "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": arguments},
                    }
                )

    async def thinking(self, text: str) -> None:
        """More of the thinking: it opens the message, in a block of its own."""
        if self.open != "thinking":
            await self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking = []
        self._thinking.append(text)
        delta = {"type": "thinking_delta", "thinking": text}
        await self.send({"type": "content_block_delta", "index": self.index, "delta": delta})

    async def close(self) -> None:
        if self.open == "thinking":
            signature = thinking_signature.sign(self._secret, "".join(self._thinking))
            delta = {"type": "signature_delta", "signature": signature}
            await self.send({"type": "content_block_delta", "index": self.index, "delta": delta})
        if self.open is not None:
            await self.send({"type": "content_block_stop", "index": self.index})
            self.open = None

    async def open_text(self) -> None:
        await self._open("text", {"type": "text", "text": ""})

    async def _open(self, kind: str, block: dict[str, Any], new: bool = False) -> None:
        if self.open == kind and not new:
            return
        await self.close()
        self.index += 1
        self.open = kind
        await self.send({"type": "content_block_start", "index": self.index, "content_block": block})


async def relay(
    response: web.StreamResponse,
    choices: Choices,
    request_id: str,
    work: protocol.Request,
    plan: ToolPlan,
    keepalive: float,
    secret: str = "",
) -> None:
    blocks = _Blocks(response, secret)
    reader = ToolCallReader(plan, "toolu_")
    await blocks.send(
        {"type": "message_start", "message": message_body(request_id, work.model, [], None, [], choices.prompt_tokens)}
    )
    await blocks.send({"type": "ping"})
    async for item in choices.events(keepalive):
        if item is None:
            await blocks.send({"type": "ping"})
            continue
        _, event = item
        if isinstance(event, Delta):
            if event.reasoning:
                await blocks.thinking(event.reasoning)
            await blocks.piece(reader.feed(event.text))
            continue
        await blocks.piece(reader.finish())
        if blocks.index < 0:  # an empty answer still has its (empty) text block
            await blocks.open_text()
        await blocks.close()
        delta = {
            "stop_reason": stop_reason(event, reader.calls, reader.forced_done),
            "stop_sequence": event.stop_sequence,
        }
        await blocks.send({"type": "message_delta", "delta": delta, "usage": usage_body(event.usage)})
        await blocks.send({"type": "message_stop"})


async def count_tokens(request: web.Request) -> web.Response:
    """Asks a worker, the one that knows the model's tokenizer and chat template, to tokenize the
    conversation (a `tokenize` task: nothing is generated)."""
    gateway = gateway_of(request)
    body = await read_json_object(request)
    refuse_unknown(body, COUNT_PARAMS)
    model = await gateway.models.require(required_str(body, "model"))
    plan = tool_calls.anthropic_plan(body)
    chat = parse_messages(body, gateway.config.thinking_secret)
    template_kwargs = parse_thinking(body, None)["template_kwargs"]
    work = new_request(
        gateway, new_request_id("count_"), model, protocol.SamplingParams(max_tokens=1),
        messages=chat, tools=plan.tools, continue_final=continues_answer(chat), task="tokenize",
        template_kwargs=template_kwargs,
    )  # fmt: skip
    async with Generation(gateway, work, "count_tokens", timed=False) as generation:
        _, done = await generation.result()
    return web.json_response({"input_tokens": done.usage.prompt_tokens})
