"""A Responses API request body, checked and turned into what the chat path takes.

Every parameter OpenAI's `POST /v1/responses` defines is either read here or refused by name (a
400 in OpenAI's error shape, `param` naming it); none is dropped unread. A parameter set to null
counts as not given (the SDK sends null only when a caller passes None). docs/api.md lists them.

The request becomes a chat request: `instructions` a system message first, `input` (a string,
or a list of items) chat messages (conversation.py), function tools the chat path's tool plan
(gateway/tool_calls.py), `text.format` the chat path's grammar constraint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import protocol
from protocol.messages import MAX_LOGPROBS, MAX_TOKENS_LIMIT

from .. import openai, tool_calls
from ..config import GatewayConfig
from ..errors import ApiError
from ..tool_calls import ToolPlan
from ..validate import (
    invalid,
    optional_bool,
    optional_int,
    optional_number,
    refuse_unknown,
    required_str,
    sampling_params,
)
from .conversation import input_messages

SUPPORTED = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "stream", "stream_options", "store", "background", "previous_response_id",
    "metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier", "truncation", "max_tool_calls",
    "include", "reasoning", "top_logprobs",
}  # fmt: skip
EXTENSIONS = {
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "seed",
    "chat_template_kwargs",
}  # as chat takes them
# POST /v1/responses/input_tokens
COUNT_PARAMS = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "previous_response_id",
    "reasoning", "truncation", "chat_template_kwargs",
}  # fmt: skip
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = {LOGPROBS, "reasoning.encrypted_content"}  # the second accepted: reasoning items carry their text
SERVICE_TIERS = ("auto", "default")
MAX_METADATA = 16


@dataclass(frozen=True)
class ResponseParams:
    """A checked request: what the worker gets (messages aside) and what the response echoes."""

    model: str
    input: list[dict[str, Any]]  # the input items, as given (a string input as one user message item)
    instructions: str | None
    plan: ToolPlan
    constraint: dict[str, Any] | None
    sampling: protocol.SamplingParams
    truncate: bool
    logprobs: int | None = None  # alternatives to report per token (0-20), None for no logprobs
    thinking: dict[str, Any] = field(default_factory=dict)  # the protocol's template_kwargs and reasoning_budget
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    echo: dict[str, Any] = field(default_factory=dict)  # the response's copy of the request's settings

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages for the worker: instructions, the stored conversation continued, the input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return system + history + input_messages(self.input)


def given(body: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in body.items() if value is not None}


def parse_request(body: dict[str, Any], config: GatewayConfig) -> ResponseParams:
    body = given(body)
    refuse_unknown(body, SUPPORTED | EXTENSIONS)
    items = parse_input(body)
    input_messages(items)  # every item checked now, not when the conversation is built
    _refuse_unsupported(body)
    thinking = parse_reasoning(body)
    plan, response_tools = parse_tools(body)
    logprobs = parse_logprobs(body, plan)
    text, constraint = parse_text(body)
    if plan.constraint is not None and constraint is not None:
        raise invalid("text.format", "a forced tool call and a structured text format cannot both constrain the output")
    store = optional_bool(body, "store") is not False
    background = bool(optional_bool(body, "background"))
    if background and not store:
        raise invalid("background", "a background response is stored: leave `store` out or true")
    max_output = optional_int(body, "max_output_tokens", 1, MAX_TOKENS_LIMIT)
    truncation = _choice(body, "truncation", ("auto", "disabled"), "disabled")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise invalid("previous_response_id", "must be a string")
    return ResponseParams(
        model=required_str(body, "model"),
        input=items,
        instructions=_optional_str(body, "instructions"),
        plan=plan,
        constraint=plan.constraint or constraint,
        sampling=_sampling(body, max_output or config.default_max_tokens, config),
        truncate=truncation == "auto",
        logprobs=logprobs,
        thinking=thinking,
        stream=bool(optional_bool(body, "stream")),
        store=store,
        background=background,
        previous_response_id=previous,
        echo=_echo(body, response_tools, text, max_output, truncation)
        | {
            "top_logprobs": logprobs or 0,
            "reasoning": {"effort": body.get("reasoning", {}).get("effort"), "summary": None},
        },
    )


def parse_count(body: dict[str, Any]) -> ResponseParams:
    """The body of POST /v1/responses/input_tokens: the parts of a request that make its prompt."""
    body = given(body)
    refuse_unknown(body, COUNT_PARAMS)
    thinking = parse_reasoning(body)
    items = parse_input(body)
    input_messages(items)
    plan, _ = parse_tools(body)
    parse_text(body)
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise invalid("previous_response_id", "must be a string")
    return ResponseParams(
        model=required_str(body, "model"),
        input=items,
        instructions=_optional_str(body, "instructions"),
        plan=plan,
        constraint=None,
        sampling=protocol.SamplingParams(max_tokens=1),
        truncate=_choice(body, "truncation", ("auto", "disabled"), "disabled") == "auto",
        thinking=thinking,
        previous_response_id=previous,
    )


def parse_input(body: dict[str, Any]) -> list[dict[str, Any]]:
    value = body.get("input")
    if value is None:
        raise invalid("input", "is required: a string, or a list of input items")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input", "must be a string, or a non-empty list of input items")
    return value


def _sampling(body: dict[str, Any], max_tokens: int, config: GatewayConfig) -> protocol.SamplingParams:
    return sampling_params(
        {
            "max_tokens": max_tokens,
            "temperature": optional_number(body, "temperature", 0.0, 2.0),
            "top_p": optional_number(body, "top_p", 0.0, 1.0),
            "top_k": optional_int(body, "top_k", 0, 1 << 20),
            "min_p": optional_number(body, "min_p", 0.0, 1.0),
            "seed": optional_int(body, "seed", -(1 << 63), (1 << 64) - 1),
            "repetition_penalty": optional_number(body, "repetition_penalty", 0.01, 10.0),
            "ignore_eos": optional_bool(body, "ignore_eos"),
        },
        config.sampling_default_fields,
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """The parameters lmq reads only in some values: the others are refused by name."""
    include = body.get("include", [])
    if not isinstance(include, list):
        raise invalid("include", "must be a list")
    for index, value in enumerate(include):
        if value not in INCLUDABLE:
            raise invalid(f"include[{index}]", f"{value!r} is not supported (only {', '.join(sorted(INCLUDABLE))})")
    _choice(body, "service_tier", SERVICE_TIERS, "auto")
    optional_int(body, "max_tool_calls", 0, 1 << 20)
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or any(name != "include_obfuscation" for name in options):
        raise invalid("stream_options", "takes only `include_obfuscation`")
    optional_bool(options, "include_obfuscation")
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        _optional_str(body, name)
    _metadata(body)


def parse_logprobs(body: dict[str, Any], plan: ToolPlan) -> int | None:
    """Logprobs of the message's tokens: asked with `include: ["message.output_text.logprobs"]` (or
    `top_logprobs` > 0), `top_logprobs` alternatives each. Not beside tools, whose calls' tokens
    would have no text to belong to."""
    top = optional_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if LOGPROBS not in body.get("include", []) and not top:
        return None
    if plan.mode != "none":
        raise invalid("include", "logprobs are not supported beside tools")
    return top or 0


def parse_reasoning(body: dict[str, Any]) -> dict[str, Any]:
    """`reasoning.effort` (and lmq's `chat_template_kwargs`) as the protocol's fields, as chat's
    `reasoning_effort` maps them (gateway/openai.py): a thinking budget the worker enforces; "none"
    also tells the template not to think. Summaries are refused: lmq writes none."""
    reasoning = body.get("reasoning", {})
    if not isinstance(reasoning, dict):
        raise invalid("reasoning", "must be an object")
    for name, value in reasoning.items():
        if name != "effort" and value is not None:
            raise invalid(f"reasoning.{name}", "is not supported (a reasoning item carries the whole thinking)")
    effort = reasoning.get("effort")
    if effort is not None and effort != "none" and effort not in openai.REASONING_BUDGETS:
        raise invalid("reasoning.effort", f'must be "none" or one of {", ".join(openai.REASONING_BUDGETS)}')
    chat = {"reasoning_effort": effort, "chat_template_kwargs": body.get("chat_template_kwargs")}
    fields = openai.parse_reasoning({key: value for key, value in chat.items() if value is not None})
    return {key: value for key, value in fields.items() if value is not None}


def parse_tools(body: dict[str, Any]) -> tuple[ToolPlan, list[dict[str, Any]]]:
    """The chat path's tool plan from Responses function tools (flat: {type, name, description,
    parameters, strict}) and tool choice; and the tools as the response echoes them."""
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not tools):
        raise invalid("tools", "must be a non-empty list of function tools")
    chat_tools, echoed = [], []
    for index, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(f"tools[{index}].type", f"only function tools are supported, not {kind!r}")
        unknown = sorted(set(given(tool)) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise invalid(f"tools[{index}].{unknown[0]}", "is not supported")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        chat_tools.append({"type": "function", "function": function})
        echoed.append(
            {
                "type": "function",
                "name": tool.get("name"),
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict", True),
            }
        )
    chat_body = {
        "tools": chat_tools or None,
        "tool_choice": _chat_tool_choice(body.get("tool_choice")),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
    }
    named = body.get("tool_choice", {}).get("name") if isinstance(body.get("tool_choice"), dict) else None
    if named is not None and named not in {tool["function"].get("name") for tool in chat_tools}:
        raise invalid("tool_choice.name", f"{named!r} is not one of the given tools")
    return tool_calls.openai_plan({key: value for key, value in chat_body.items() if value is not None}), echoed


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise invalid("tool_choice.name", "is required: the function's name")
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise ApiError(
        400,
        f'tool_choice: must be "none", "auto", "required" or {{"type": "function", "name": ...}}, not {kind!r}',
        param="tool_choice",
    )


def parse_text(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`text` as the response echoes it, and the grammar constraint its format asks for."""
    text = body.get("text", {})
    if not isinstance(text, dict):
        raise invalid("text", "must be an object")
    unknown = sorted(set(given(text)) - {"format", "verbosity"})
    if unknown:
        raise invalid(f"text.{unknown[0]}", "is not supported")
    if text.get("verbosity") not in (None, "medium"):
        raise invalid("text.verbosity", "only the model's own verbosity (`medium`) is supported")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    echoed = {"format": fmt, "verbosity": "medium"}
    if kind == "text":
        return echoed, None
    if kind == "json_object":
        return echoed, {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise invalid("text.format.name", "is required: the schema's name")
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema", "must be a JSON Schema object")
        return echoed, {"type": "json_schema", "schema": fmt["schema"]}
    raise invalid("text.format.type", 'must be "text", "json_object" or "json_schema"')


def _echo(
    body: dict[str, Any], tools: list[dict[str, Any]], text: dict[str, Any], max_output: int | None, truncation: str
) -> dict[str, Any]:
    choice = body.get("tool_choice", "auto")
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": max_output,
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": body.get("metadata", {}),
        "model": body.get("model"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": "default",
        "store": body.get("store", True),
        "background": body.get("background", False),
        "temperature": body.get("temperature"),
        "text": text,
        "tool_choice": choice,
        "tools": tools,
        "top_logprobs": 0,
        "top_p": body.get("top_p"),
        "truncation": truncation,
        "user": body.get("user"),
    }


def _metadata(body: dict[str, Any]) -> None:
    metadata = body.get("metadata", {})
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA:
        raise invalid("metadata", f"must be an object of at most {MAX_METADATA} string values")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise invalid(f"metadata.{key}", "keys are at most 64 characters, values strings of at most 512")


def _optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid(name, "must be a string")
    return value


def _choice(body: dict[str, Any], name: str, choices: tuple[str, ...], default: str) -> str:
    value = body.get(name, default)
    if value not in choices:
        raise invalid(name, f"must be one of {', '.join(map(repr, choices))}, not {value!r}")
    return value
