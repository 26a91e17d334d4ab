"""Tool calls: what a request's tools and tool choice ask of the worker, and reading calls back from the text.

Both APIs come down to one plan. The worker shows `tools` to the model through its chat template
(or, for a template without tool support, a Hermes-style system prompt: worker/chat_render.py), and
the model answers in the Hermes format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

- `auto`: the model chooses; text outside the tags is the answer's content, each tag a call.
- `required` / Anthropic `any`: the output is constrained (the protocol's `tool_calls` constraint,
  a grammar the worker builds) to one or more such tags (one when parallel calls are off), each
  naming a given tool with arguments valid for its schema.
- a named tool: the output is constrained to that tool's arguments, a JSON object valid for its schema.
- `none`: the tools are not shown and nothing is parsed.

`ToolCallReader` reads a stream of text deltas and returns what to relay: plain text, and calls as
they complete (a named tool's arguments are streamed as they come).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from .errors import ApiError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] | None = None  # OpenAI function definitions, for the template
    named: str | None = None
    parallel: bool = True

    @property
    def constraint(self) -> dict[str, Any] | None:
        if self.mode == "named":
            return {"type": "json_schema", "schema": _parameters(self._tool(self.named))}
        if self.mode == "required":
            return {"type": "tool_calls", "tools": self.tools, "parallel": self.parallel}
        return None

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(tool for tool in self.tools or [] if tool["function"]["name"] == name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def openai_plan(body: dict[str, Any]) -> ToolPlan:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls: must be true or false", param="parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice: needs `tools`", param="tool_choice")
        return ToolPlan("none")
    tools = _openai_tools(tools)
    if choice is None or choice in ("auto", "none", "required"):
        return ToolPlan(choice or "auto", tools if choice != "none" else None, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return _named(tools, choice["function"].get("name"), "tool_choice.function.name", parallel)
    raise ApiError(
        400,
        'tool_choice: must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def anthropic_plan(body: dict[str, Any]) -> ToolPlan:
    tools = body.get("tools")
    choice = body.get("tool_choice") or {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ApiError(400, 'tool_choice: must be {"type": "auto" | "any" | "tool" | "none"}', param="tool_choice")
    if tools is None:
        if choice["type"] not in ("auto", "none"):
            raise ApiError(400, "tool_choice: needs `tools`", param="tool_choice")
        return ToolPlan("none")
    tools = [_anthropic_tool(tool, i) for i, tool in enumerate(tools if isinstance(tools, list) else [None])]
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice["type"]
    if kind == "tool":
        return _named(tools, choice.get("name"), "tool_choice.name", parallel)
    mode = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return ToolPlan(mode, tools if mode != "none" else None, parallel=parallel)


def _named(tools: list[dict[str, Any]], name: Any, param: str, parallel: bool) -> ToolPlan:
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ApiError(400, f"{param}: {name!r} is not one of the given tools", param=param)
    return ToolPlan("named", tools, named=name, parallel=parallel)


def _openai_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise ApiError(400, "tools: must be a non-empty list of tools", param="tools")
    checked = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise ApiError(
                400,
                f'tools[{i}]: must be {{"type": "function", "function": {{"name", "description", "parameters"}}}}',
                param=f"tools[{i}]",
            )
        checked.append(
            {
                "type": "function",
                "function": _function(
                    function.get("name"),
                    function.get("description"),
                    function.get("parameters"),
                    f"tools[{i}].function",
                ),
            }
        )
    return checked


def _anthropic_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools.{index}"
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        raise ApiError(
            400, f"{where}: only custom tools ({{name, description, input_schema}}) are supported", param=where
        )
    return {
        "type": "function",
        "function": _function(tool.get("name"), tool.get("description"), tool.get("input_schema"), where),
    }


def _function(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name or len(name) > 128:
        raise ApiError(400, f"{where}.name: must be a string of 1-128 characters", param=f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"{where}.description: must be a string", param=f"{where}.description")
    if parameters is not None and not isinstance(parameters, dict):
        raise ApiError(400, f"{where}: the parameters' JSON Schema must be an object", param=where)
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return function


# ---------------------------------------------------------------- reading calls back


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Piece:
    """What to relay for one text delta: content text, calls that started, argument text of calls."""

    text: str = ""
    started: list[ToolCall] = field(default_factory=list)
    arguments: list[tuple[int, str]] = field(default_factory=list)  # (call index, more argument text)


def new_call_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class ToolCallReader:
    def __init__(self, plan: ToolPlan, id_prefix: str = "call_"):
        self.plan = plan
        self.id_prefix = id_prefix
        self.calls: list[ToolCall] = []
        self._pending = ""  # text that may still be (the start of) a tag

    def feed(self, text: str) -> Piece:
        if self.plan.mode == "none":
            return Piece(text=text)
        if self.plan.mode == "named":
            return self._feed_named(text)
        self._pending += text
        return self._forced(self._drain(final=False))

    def finish(self) -> Piece:
        """The end of the output: text held back that never became a call is content after all
        (under `auto`; a forced call's text is never content, see `_forced`)."""
        if self.plan.mode in ("none", "named"):
            return Piece()
        return self._forced(self._drain(final=True))

    @property
    def forced_done(self) -> bool:
        """A forced (`required`) turn that holds a complete call: it ends with the calls, whatever
        the output ran on to (a repeated call, or a call cut at max_tokens)."""
        return self.plan.mode == "required" and bool(self.calls)

    def _forced(self, piece: Piece) -> Piece:
        """Under `required` the grammar admits only calls, so any text is a call's raw tags (one cut
        off at max_tokens): it is never content."""
        if self.plan.mode == "required":
            piece.text = ""
        return piece

    def _feed_named(self, text: str) -> Piece:
        piece = Piece()
        if not self.calls:
            self.calls.append(ToolCall(0, new_call_id(self.id_prefix), self.plan.named or "", ""))
            piece.started.append(self.calls[0])
        if text:
            self.calls[0].arguments += text
            piece.arguments.append((0, text))
        return piece

    def _drain(self, final: bool) -> Piece:
        piece = Piece()
        while self._pending:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._pending, OPEN)
                piece.text += self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                return piece
            end = self._pending.find(CLOSE, start)
            if end < 0:
                piece.text += self._pending[:start]
                self._pending = self._pending[start:]
                if final:
                    piece.text += self._pending
                    self._pending = ""
                return piece
            piece.text += self._pending[:start]
            body = self._pending[start + len(OPEN) : end]
            self._pending = (
                self._pending[end + len(CLOSE) :].lstrip("\n") if not final else self._pending[end + len(CLOSE) :]
            )
            call = self._parse(body)
            if call is _REPEAT:
                continue  # a forced call repeated verbatim: the grammar let the model run on
            if call is None:
                piece.text += OPEN + body + CLOSE
            else:
                piece.started.append(call)
                piece.arguments.append((call.index, call.arguments))
        return piece

    def _parse(self, body: str) -> ToolCall | None:
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        if self.plan.mode == "required" and any(
            c.name == data["name"] and json.loads(c.arguments) == arguments for c in self.calls
        ):
            return _REPEAT
        call = ToolCall(
            len(self.calls), new_call_id(self.id_prefix), data["name"], json.dumps(arguments, ensure_ascii=False)
        )
        self.calls.append(call)
        return call


_REPEAT = ToolCall(-1, "", "", "")


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may become the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
