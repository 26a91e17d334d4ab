"""What a client got, in one shape for every API: the choices' text, tool calls and finish, or the error it saw.

An `Answer` is built by reading a response the way that API's client would (bench/soak/traffic.py), and
`signature()` is what two answers must share to be the same answer: per choice its text, its tool
calls (name and arguments, not their random ids) and its finish reason. The ledger compares it with
the reference answer of the same request (bench/soak/ledger.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Choice:
    text: str = ""
    tools: list[list[str]] = field(default_factory=list)  # [name, arguments JSON] per call, in order
    finish: str | None = None

    def tool(self, index: int) -> list[str]:
        while len(self.tools) <= index:
            self.tools.append(["", ""])
        return self.tools[index]


@dataclass
class Answer:
    status: int | None = None
    choices: dict[int, Choice] = field(default_factory=dict)
    complete: bool = False  # the API's end marker came ([DONE], message_stop, a `done` event, a whole body)
    error: str | None = None  # what made a failure visible: a status, an error event, a dropped connection
    hung: bool = False  # neither an answer nor an error within the client's time limit
    ttft: float | None = None  # seconds to the first text or tool call (streams)
    extra_after_end: bool = False  # anything after the end marker

    def choice(self, index: int) -> Choice:
        return self.choices.setdefault(index, Choice())

    def signature(self) -> list:
        return [[index, c.text, c.tools, c.finish] for index, c in sorted(self.choices.items())]

    def describe(self) -> str:
        return json.dumps(
            {"status": self.status, "error": self.error, "hung": self.hung, "complete": self.complete,
             "choices": self.signature()}
        )[:600]  # fmt: skip


def openai_body(answer: Answer, body: dict[str, Any]) -> None:
    """A whole chat completion (`POST /v1/chat/completions`, stream off)."""
    for choice in body.get("choices") or []:
        got = answer.choice(choice["index"])
        message = choice.get("message") or {}
        got.text = message.get("content") or ""
        got.tools = [
            [call["function"]["name"], call["function"]["arguments"]] for call in message.get("tool_calls") or []
        ]
        got.finish = choice.get("finish_reason")
    answer.complete = True


def openai_chunk(answer: Answer, chunk: dict[str, Any]) -> bool:
    """One streamed chunk; True when it carried text or a tool call (for the time to first token)."""
    if "error" in chunk:
        answer.error = f"error event: {json.dumps(chunk['error'])[:300]}"
        return False
    carried = False
    for choice in chunk.get("choices") or []:
        got = answer.choice(choice["index"])
        delta = choice.get("delta") or {}
        if delta.get("content"):
            got.text += delta["content"]
            carried = True
        for call in delta.get("tool_calls") or []:
            slot = got.tool(call.get("index", 0))
            function = call.get("function") or {}
            slot[0] += function.get("name") or ""
            slot[1] += function.get("arguments") or ""
            carried = True
        got.finish = choice.get("finish_reason") or got.finish
    return carried


def anthropic_body(answer: Answer, body: dict[str, Any]) -> None:
    """A whole message (`POST /v1/messages`, stream off)."""
    got = answer.choice(0)
    for block in body.get("content") or []:
        if block.get("type") == "text":
            got.text += block["text"]
        elif block.get("type") == "tool_use":
            got.tools.append([block["name"], json.dumps(block["input"], sort_keys=True)])
    got.finish = body.get("stop_reason")
    answer.complete = True


def anthropic_event(answer: Answer, event: dict[str, Any], blocks: dict[int, list]) -> bool:
    """One streamed event (`blocks`: index -> [kind, name, partial JSON] of the stream's blocks so far)."""
    kind = event.get("type")
    got = answer.choice(0)
    if kind == "error":
        answer.error = f"error event: {json.dumps(event.get('error'))[:300]}"
    elif kind == "content_block_start":
        block = event["content_block"]
        blocks[event["index"]] = [block.get("type"), block.get("name", ""), ""]
    elif kind == "content_block_delta":
        delta = event["delta"]
        if delta.get("type") == "text_delta":
            got.text += delta["text"]
            return bool(delta["text"])
        if delta.get("type") == "input_json_delta":
            blocks[event["index"]][2] += delta["partial_json"]
            return True
    elif kind == "message_delta":
        got.finish = (event.get("delta") or {}).get("stop_reason") or got.finish
    elif kind == "message_stop":
        got.tools = [
            [name, json.dumps(json.loads(partial or "{}"), sort_keys=True)]
            for _, (block_kind, name, partial) in sorted(blocks.items())
            if block_kind == "tool_use"
        ]
        answer.complete = True
    return False
