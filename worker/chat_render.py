"""From protocol chat messages (and tool definitions) to the text a model reads, through its chat template.

What the template gets is what Hugging Face templates expect: `messages` with `role`/`content`, an
assistant's `tool_calls` as `{id, type, function: {name, arguments}}` with `arguments` a map, a
tool result as role `tool` with `tool_call_id`, and `tools` in the context. Two requests change
the conversation before it is rendered:

- OpenAI's `developer` role is the system prompt under a newer name: it renders as `system`, so a
  template that adds a default system prompt when none is given does not add one beside it.
- A template that never mentions `tools` (SmolLM2's, for one) cannot show them to the model. For
  those, the tools are described in the system prompt in the Hermes format Qwen's templates use
  (`<tools>` signatures, answers as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`), an
  assistant's earlier calls are written out in that format and tool results become user turns
  wrapped in `<tool_response>`. The gateway reads tool calls back in the same format.

`template_kwargs`: a request's own template variables beside these (Qwen3's `enable_thinking`).

`continue_final`: the last message is an assistant's unfinished answer (an Anthropic prefill): the
text ends right after its content, with no end-of-turn, so the model continues it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from worker.grammar import lark_json

if TYPE_CHECKING:
    from worker.model.loader import LoadedModel

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def render_chat(
    model: LoadedModel,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    continue_final: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    template = model.chat_template
    extra = template_kwargs or {}  # the request's own template variables (enable_thinking, ...)
    messages = [_as_template_message(message) for message in messages]
    if tools and not template_knows_tools(template.source):
        messages, tools = _describe_tools_in_prompt(messages, tools), None
    if continue_final and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages, continue_final = messages[:-1], False  # nothing to continue: a new answer
    if not continue_final:
        return template.render(messages, add_generation_prompt=True, tools=tools or None, **extra)
    if messages[-1]["role"] != "assistant":
        raise ValueError("continue_final: the last message must be the assistant's answer to continue")
    text = template.render(messages, add_generation_prompt=False, tools=tools or None, **extra)
    return _cut_after_last_content(text, messages[-1]["content"])


def template_knows_tools(source: str) -> bool:
    return "tools" in source


def _as_template_message(message: dict[str, Any]) -> dict[str, Any]:
    message = dict(message)
    if message["role"] == "developer":
        message["role"] = "system"
    if "tool_calls" in message:
        message["tool_calls"] = [_with_arguments_map(call) for call in message["tool_calls"]]
    return message


def _with_arguments_map(call: dict[str, Any]) -> dict[str, Any]:
    """Templates write `arguments | tojson`: a JSON string from the client becomes the map it holds."""
    arguments = call["function"]["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {**call, "function": {**call["function"], "arguments": arguments}}


def _describe_tools_in_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    preamble = TOOLS_PREAMBLE.format(signatures=signatures)
    if messages[0]["role"] == "system":
        head = [{"role": "system", "content": f"{messages[0]['content']}\n\n{preamble}"}]
        messages = messages[1:]
    else:
        head = [{"role": "system", "content": preamble}]
    return head + [_hermes_message(message) for message in messages]


def _hermes_message(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if message.get("tool_calls"):
        calls = [hermes_call(call["function"]["name"], call["function"]["arguments"]) for call in message["tool_calls"]]
        content = "\n".join(part for part in [message["content"], *calls] if part)
        return {"role": "assistant", "content": content}
    return message


def tool_calls_grammar(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The protocol's `tool_calls` constraint as the Lark grammar it means: one Hermes tag (or several,
    when parallel calls are allowed), each a call of one of `tools` with arguments valid for its schema."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "arguments": tool["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    call = lark_json({"anyOf": variants})
    repeat = "+" if parallel else ""
    return {
        "type": "lark",
        "grammar": f'start: call{repeat}\ncall: "<tool_call>\\n" json_call "\\n</tool_call>" "\\n"?\njson_call: {call}\n',
    }


def hermes_call(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _cut_after_last_content(text: str, content: str) -> str:
    """The rendered conversation up to the end of the final message's content (its end-of-turn cut off)."""
    end = text.rfind(content) if content else -1
    if end < 0:
        raise ValueError("continue_final: the chat template does not render the final message's content verbatim")
    return text[: end + len(content)]
