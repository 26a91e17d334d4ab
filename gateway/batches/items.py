"""One batch item as the live endpoint sees it: the same checks, the same protocol request, the same body.

Each endpoint a batch may call has a kind here that builds the item's protocol request with the
live handler's own parse functions (gateway/openai.py, gateway/anthropic.py), so an item is valid
exactly when the same body sent to the endpoint would be, and renders a finished item's answer
with the handler's own shapes. The few differences are a batch's: `stream` and `n` > 1 are
refused (an item has one answer, written to a file), and the model need not be served at upload.
A body is checked when its item runs (`batch_request`), not when the batch is made: a refused one
ends that item `errored` with the endpoint's status and error (parse.py checks the format up front).

This is the one module that follows those handlers' steps; when they change, this follows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import protocol

from .. import anthropic, openai, tool_calls
from ..choices import total_usage
from ..context import Gateway
from ..errors import WORKER_ERROR_STATUS, ApiError, anthropic_error_body, openai_error_body
from ..generation import Done, Usage, new_request
from ..openai_shapes import ChatShape, CompletionShape
from ..tool_calls import ToolCallReader
from ..validate import invalid, optional_bool, refuse_unknown, required_str

CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
OPENAI_ENDPOINTS = (CHAT, COMPLETIONS)


def _one_answer(body: dict[str, Any]) -> None:
    if optional_bool(body, "stream"):
        raise invalid("stream", "a batch item is answered whole: leave `stream` out or false")
    if (body.get("n") or 1) != 1:
        raise invalid("n", "a batch item has one answer: leave `n` out or 1")


# ---------------------------------------------------------------- requests, as the handlers build them


def _chat_request(gateway: Gateway, body: dict[str, Any], request_id: str) -> protocol.Request:
    refuse_unknown(body, openai.CHAT_PARAMS)
    openai.refuse_storing(body)
    model = required_str(body, "model")
    plan = tool_calls.openai_plan(body)
    return new_request(
        gateway, request_id, model, openai.parse_sampling(body, gateway.config),
        messages=openai.parse_messages(body), tools=plan.tools,
        constraint=plan.constraint or openai.parse_response_format(body), logprobs=openai.parse_chat_logprobs(body),
        **openai.parse_reasoning(body),
    )  # fmt: skip


def _completion_request(gateway: Gateway, body: dict[str, Any], request_id: str) -> protocol.Request:
    refuse_unknown(body, openai.COMPLETION_PARAMS)
    openai.refuse_storing(body)
    model = required_str(body, "model")
    openai.refuse_unsupported_completion_options(body)
    sampling = openai.parse_sampling(body, gateway.config)
    return new_request(
        gateway,
        request_id,
        model,
        sampling,
        logprobs=openai.parse_completion_logprobs(body),
        **openai.parse_prompt(body),
    )


def _message_request(gateway: Gateway, body: dict[str, Any], request_id: str) -> protocol.Request:
    refuse_unknown(body, anthropic.MESSAGES_PARAMS)
    anthropic.refuse_thinking(body)
    model = required_str(body, "model")
    sampling = anthropic.parse_sampling(body, gateway.config.sampling_default_fields)
    plan = tool_calls.anthropic_plan(body)
    chat = anthropic.parse_messages(body, gateway.config.thinking_secret)
    return new_request(
        gateway, request_id, model, sampling,
        messages=chat, tools=plan.tools, constraint=plan.constraint, continue_final=anthropic.continues_answer(chat),
        **anthropic.parse_thinking(body, sampling.max_tokens),  # thinking off, as on the live endpoint
    )  # fmt: skip


# ---------------------------------------------------------------- answers, as the handlers write them


async def _chat_body(
    body: dict[str, Any], model: str, request_id: str, text: str, logprobs: list, done: Done
) -> dict[str, Any]:
    shape = ChatShape(request_id, model, False, openai.parse_chat_logprobs(body))
    return await openai.complete_chat(_Finished([(text, logprobs, done)]), shape, tool_calls.openai_plan(body))


async def _completion_body(
    body: dict[str, Any], model: str, request_id: str, text: str, logprobs: list, done: Done
) -> dict[str, Any]:
    shape = CompletionShape(request_id, model, False, openai.parse_completion_logprobs(body))
    return shape.complete([(text, logprobs, done.finish_reason)], total_usage([done], 1))


async def _message_body(
    body: dict[str, Any], model: str, request_id: str, text: str, logprobs: list, done: Done
) -> dict[str, Any]:
    plan = tool_calls.anthropic_plan(body)
    reader = ToolCallReader(plan, "toolu_")
    content_text = reader.feed(text).text + reader.finish().text
    content = [{"type": "text", "text": content_text}] if content_text.strip() or not reader.calls else []
    content += [anthropic.tool_use_block(call) for call in reader.calls]
    return anthropic.message_body(request_id, model, content, done, reader.calls)


class _Finished:
    """The answers of a finished item, in the form openai.complete_chat reads them from live choices."""

    def __init__(self, results: list[tuple[str, list, Done]]):
        self._results = results

    async def results(self) -> list[tuple[str, list, Done]]:
        return self._results


@dataclass(frozen=True)
class Kind:
    build: Callable[[Gateway, dict[str, Any], str], protocol.Request]
    render: Callable[..., Any]


KINDS = {
    CHAT: Kind(_chat_request, _chat_body),
    COMPLETIONS: Kind(_completion_request, _completion_body),
    MESSAGES: Kind(_message_request, _message_body),
}


# ---------------------------------------------------------------- the runner's and the handlers' entry points


def batch_request(
    gateway: Gateway, item: dict[str, Any], request_id: str, reply_key: str, deadline: float
) -> protocol.Request:
    """The item's protocol request: priority `batch`, its events on a durable reply stream of its own.
    Raises ApiError where the endpoint would refuse the body."""
    body = item["body"]
    if not isinstance(body, dict):
        raise ApiError(400, "body: must be a JSON object", param="body")
    _one_answer(body)
    request = KINDS[item["url"]].build(gateway, body, request_id)
    return dataclasses.replace(request, reply=protocol.Reply("stream", reply_key), deadline=deadline, priority="batch")


def done_of(outcome: dict[str, Any]) -> Done:
    usage = outcome.get("usage") or {}
    finished = outcome.get("done") or {}
    return Done(
        finish_reason=finished.get("finish_reason", "stop"),
        stop_sequence=finished.get("stop_sequence"),
        usage=Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), usage.get("cached_tokens", 0)),
        extra=finished.get("extra") or {},
    )


async def answer_body(item: dict[str, Any], outcome: dict[str, Any]) -> dict[str, Any]:
    """A succeeded item's answer, the body the live endpoint would have sent."""
    body = item["body"]
    kind = KINDS[item["url"]]
    return await kind.render(
        body,
        body.get("model", ""),
        outcome["request_id"],
        outcome.get("text", ""),
        outcome.get("logprobs") or [],
        done_of(outcome),
    )


def error_status(outcome: dict[str, Any]) -> int:
    error = outcome.get("error") or {}
    return int(error.get("status") or WORKER_ERROR_STATUS.get(error.get("code", ""), 500))


def openai_error(outcome: dict[str, Any]) -> dict[str, Any]:
    error = outcome.get("error") or {}
    return openai_error_body(
        ApiError(error_status(outcome), error.get("message", ""), param=error.get("param"), code=error.get("code"))
    )


def anthropic_error(outcome: dict[str, Any]) -> dict[str, Any]:
    error = outcome.get("error") or {}
    return anthropic_error_body(ApiError(error_status(outcome), error.get("message", "")))
