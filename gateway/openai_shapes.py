"""The bodies OpenAI's API answers with: whole completions and streamed chunks, for chat and legacy completions.

Logprobs arrive from the worker per token as `{token, bytes, logprob, top: [...]}` (protocol
`delta`) and are written in each endpoint's own shape: chat's `logprobs.content` list, the legacy
`tokens` / `token_logprobs` / `top_logprobs` / `text_offset` columns.
"""

from __future__ import annotations

import time
from typing import Any

from .generation import Done, Usage
from .tool_calls import Piece, ToolCall


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


class _Shape:
    """What both endpoints' bodies share: id, created and model on every chunk, and usage only when asked."""

    chunk_object: str  # the `object` of a streamed chunk

    def __init__(self, request_id: str, model: str, include_usage: bool = False, top_logprobs: int | None = None):
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.top_logprobs = top_logprobs  # None: logprobs not asked for

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._envelope(self.chunk_object, []) | {"usage": usage_body(usage)}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object, [choice])
        return chunk | {"usage": None} if self.include_usage else chunk

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }


class ChatShape(_Shape):
    """Bodies of /v1/chat/completions: one `chat.completion`, or `chat.completion.chunk`s."""

    chunk_object = "chat.completion.chunk"
    api = "chat_completions"  # in metrics

    def complete(
        self, choices: list[tuple[str, list[dict[str, Any]], list[ToolCall], str, str]], usage: Usage
    ) -> dict[str, Any]:
        """choices: (content, logprobs, tool calls, finish reason, reasoning) per choice."""
        bodies = [
            {
                "index": index,
                "message": _message(text, calls, reasoning),
                "logprobs": self._logprobs(logprobs),
                "finish_reason": reason,
            }
            for index, (text, logprobs, calls, reason, reasoning) in enumerate(choices)
        ]
        return self._envelope("chat.completion", bodies) | {"usage": usage_body(usage)}

    def first_chunk(self, index: int) -> dict[str, Any]:
        return self._chunk(self._delta(index, {"role": "assistant", "content": ""}, None))

    def piece_chunks(
        self, index: int, piece: Piece, logprobs: list[dict[str, Any]] | None, reasoning: str = ""
    ) -> list[dict[str, Any]]:
        """The chunks of one delta: its thinking, its text (with the delta's logprobs), then tool-call fragments."""
        chunks = []
        if reasoning:
            chunks.append(self._chunk(self._delta(index, _reasoning(reasoning), None)))
        if piece.text or logprobs:
            chunks.append(self._chunk(self._delta(index, {"content": piece.text}, None, logprobs)))
        started = {call.index for call in piece.started}
        for call in piece.started:
            head = {
                "index": call.index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            chunks.append(self._chunk(self._delta(index, {"tool_calls": [head]}, None)))
        for call_index, arguments in piece.arguments:
            if arguments or call_index not in started:
                fragment = {"index": call_index, "function": {"arguments": arguments}}
                chunks.append(self._chunk(self._delta(index, {"tool_calls": [fragment]}, None)))
        return chunks

    def finish_chunk(self, index: int, finish_reason: str) -> dict[str, Any]:
        return self._chunk(self._delta(index, {}, finish_reason))

    def _delta(
        self, index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}

    def _logprobs(self, logprobs: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        if self.top_logprobs is None or logprobs is None:
            return None
        return {"content": [_chat_token(entry, self.top_logprobs) for entry in logprobs], "refusal": None}


def _reasoning(text: str) -> dict[str, str]:
    """A thinking model's thinking under both names clients read: llama-server's and DeepSeek's
    `reasoning_content`, vLLM's newer `reasoning`."""
    return {"reasoning_content": text, "reasoning": text}


def _message(text: str, calls: list[ToolCall], reasoning: str = "") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if reasoning:
        message |= _reasoning(reasoning)
    if calls:
        message["content"] = text.strip() or None
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls
        ]
    return message


def _chat_token(entry: dict[str, Any], top: int) -> dict[str, Any]:
    return _chat_alternative(entry) | {"top_logprobs": [_chat_alternative(alt) for alt in entry.get("top", [])[:top]]}


def _chat_alternative(entry: dict[str, Any]) -> dict[str, Any]:
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": list(entry["bytes"])}


class CompletionShape(_Shape):
    """Bodies of the legacy /v1/completions: `text_completion` objects, whole or in chunks."""

    chunk_object = "text_completion"
    api = "completions"

    def complete(self, choices: list[tuple[str, list[dict[str, Any]], str]], usage: Usage) -> dict[str, Any]:
        bodies = [
            self._choice(index, text, reason, logprobs, 0) for index, (text, logprobs, reason) in enumerate(choices)
        ]
        return self._envelope("text_completion", bodies) | {"usage": usage_body(usage)}

    def text_chunk(
        self, index: int, text: str, logprobs: list[dict[str, Any]] | None, text_offset: int
    ) -> dict[str, Any]:
        return self._chunk(self._choice(index, text, None, logprobs, text_offset))

    def finish_chunk(self, index: int, finish_reason: str) -> dict[str, Any]:
        return self._chunk(self._choice(index, "", finish_reason, None, 0))

    def _choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: list[dict[str, Any]] | None, text_offset: int
    ) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(logprobs, text_offset),
            "finish_reason": finish_reason,
        }

    def _logprobs(self, logprobs: list[dict[str, Any]] | None, text_offset: int) -> dict[str, Any] | None:
        """The legacy columns; `text_offset` counts characters from the start of the completion."""
        if self.top_logprobs is None or logprobs is None:
            return None
        offsets, position = [], text_offset
        for entry in logprobs:
            offsets.append(position)
            position += len(entry["token"])
        return {
            "tokens": [entry["token"] for entry in logprobs],
            "token_logprobs": [entry["logprob"] for entry in logprobs],
            "top_logprobs": [
                {alt["token"]: alt["logprob"] for alt in entry.get("top", [])[: self.top_logprobs]}
                for entry in logprobs
            ],
            "text_offset": offsets,
        }


def finish_reason(done: Done, calls: list[ToolCall]) -> str:
    return "tool_calls" if calls else done.finish_reason
