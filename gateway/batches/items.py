"""One batch item as the live endpoint sees it: the same checks, the same protocol request, the same body.

Each endpoint a batch may call has a kind here that builds the item's protocol request with the
live handler's own parse functions (gateway/openai.py, gateway/anthropic.py), so an item is valid
exactly when the same body sent to the endpoint would be, and renders a finished item's answer
with the handler's own shapes. The few differences are a batch's: `stream` and `n` > 1 are
refused (an item has one answer, written to a file), and the model need not be served at upload.
A body is checked when its item runs (`batch_request`), not when the batch is made: a refused one
ends that item `errored` with the endpoint's status and error (parse.py checks the format up front).

A messages item is built and answered by the live handler's own functions (anthropic.py
`message_request`, `complete_message`: a copy had drifted, ignoring `output_config` and a forced
call's end); the OpenAI kinds follow the handlers' steps here, and when those change, these follow.
A thinking model's answer is rendered from the outcome's split (item_run.py `answer`): the answer's
text, and its thinking as `Done.reasoning`, as live.
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
    work, _ = anthropic.message_request(gateway, body, required_str(body, "model"), request_id)
    return work


# ---------------------------------------------------------------- answers, as the handlers write them


async def _chat_body(
    body: dict[str, Any], model: str, request_id: str, text: str, logprobs: list, done: Done, secret: str | None
) -> dict[str, Any]:
    shape = ChatShape(request_id, model, False, openai.parse_chat_logprobs(body))
    return await openai.complete_chat(_Finished([(text, logprobs, done)]), shape, tool_calls.openai_plan(body))


async def _completion_body(
    body: dict[str, Any], model: str, request_id: str, text: str, logprobs: list, done: Done, secret: str | None
) -> dict[str, Any]:
    shape = CompletionShape(request_id, model, False, openai.parse_completion_logprobs(body))
    return shape.complete([(text, logprobs, done.finish_reason)], total_usage([done], 1))


async def _message_body(
    body: dict[str, Any], model: str, request_id: str, text: str, logprobs: list, done: Done, secret: str | None
) -> dict[str, Any]:
    if secret is None:
        raise ValueError("a messages answer's thinking is signed: answer_body needs the gateway's thinking_secret")
    return anthropic.complete_message(request_id, model, text, done, tool_calls.anthropic_plan(body), secret)


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
    """The `done` of a succeeded outcome, with a thinking model's thinking (an outcome written before
    batches split it has none: its thinking stays in its text, as it was answered)."""
    usage = outcome.get("usage") or {}
    finished = outcome.get("done") or {}
    return Done(
        finish_reason=finished.get("finish_reason", "stop"),
        stop_sequence=finished.get("stop_sequence"),
        usage=Usage(
            usage.get("prompt_tokens", 0),
            usage.get("completion_tokens", 0),
            usage.get("cached_tokens", 0),
            outcome.get("reasoning_tokens", 0),
        ),
        extra=finished.get("extra") or {},
        reasoning=outcome.get("reasoning", ""),
    )


async def answer_body(
    item: dict[str, Any], outcome: dict[str, Any], thinking_secret: str | None = None
) -> dict[str, Any]:
    """A succeeded item's answer, the body the live endpoint would have sent. `thinking_secret`: the
    gateway's, which signs a messages answer's thinking block (needed for messages items only)."""
    body = item["body"]
    kind = KINDS[item["url"]]
    return await kind.render(
        body,
        body.get("model", ""),
        outcome["request_id"],
        outcome.get("text", ""),
        outcome.get("logprobs") or [],
        done_of(outcome),
        thinking_secret,
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
