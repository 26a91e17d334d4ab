"""Responses items as chat messages: a request's input items, and a stored response's output (its turn).

Input items: messages (`role` user, system, developer or assistant; `content` a string or a list
of `input_text` / `output_text` parts), `function_call` items (an assistant's call) and
`function_call_output` items (the call's result, a `tool` message). `reasoning` items are taken
and left out of the prompt, as chat templates drop earlier turns' thinking. Any other item (images,
files, built-in tools' calls, item references) is refused by name.

Consecutive assistant text and function calls are one assistant turn, as a chat template expects.
"""

from __future__ import annotations

import json
from typing import Any

from ..validate import invalid

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise invalid(where, "must be an input item object")
        kind = item.get("type", "message")
        if kind == "message":
            _message(messages, item, where)
        elif kind == "function_call":
            _call(messages, item, where)
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "content": _output(item, where), "tool_call_id": _str(item, "call_id", where)}
            )
        elif kind != "reasoning":
            raise invalid(
                f"{where}.type",
                f"{kind!r} items are not supported (messages, function_call, function_call_output, reasoning)",
            )
    return messages


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A finished response's output items as the assistant's turn (for previous_response_id)."""
    return input_messages([item for item in output if item.get("type") in ("message", "function_call")])


def listed_items(items: list[dict[str, Any]], response_id: str) -> list[dict[str, Any]]:
    """A request's (checked) input items as GET /v1/responses/{id}/input_items lists them: each with
    an id (its own, or one made from the response's and its place) and text content as parts."""
    suffix = response_id.removeprefix("resp_")
    listed = []
    for index, item in enumerate(items):
        item = {"type": "message", **item}
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[
            item["type"]
        ]
        item.setdefault("id", f"{prefix}_{suffix}_in{index}")
        if item["type"] == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            content = item.get("content")
            item["content"] = [{"type": part, "text": content}] if isinstance(content, str) else content
        item.setdefault("status", "completed")
        listed.append(item)
    return listed


def _message(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}")
    content = _text(item.get("content"), f"{where}.content")
    if role == "assistant" and messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        messages[-1]["content"] += content
        return
    messages.append({"role": role, "content": content})


def _call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise invalid(f"{where}.arguments", "must be a JSON string")
    call = {
        "id": _str(item, "call_id", where),
        "type": "function",
        "function": {"name": _str(item, "name", where), "arguments": arguments},
    }
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    messages[-1].setdefault("tool_calls", []).append(call)


def _output(item: dict[str, Any], where: str) -> str:
    output = item.get("output")
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _text(output, f"{where}.output")
    if isinstance(output, (dict, int, float, bool)):
        return json.dumps(output)
    raise invalid(f"{where}.output", "must be a string or a list of input_text parts")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, "must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise invalid(f"{where}[{index}]", f"only text parts (input_text, output_text) are supported, not {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _str(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise invalid(f"{where}.{name}", "is required: a string")
    return value
