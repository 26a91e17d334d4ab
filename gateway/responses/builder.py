"""One response as it is generated: its output items and the stream events that build them.

A `ResponseBuilder` is fed the generation's text (and its reasoning text, for a thinking model)
and the final `done`; each call returns the events that step makes, numbered by `sequence_number`
from 0, in the order OpenAI sends them and the SDK's `responses.stream()` accumulates them:

    response.created, response.queued (background) / response.in_progress
    per item: response.output_item.added
      a message:    response.content_part.added, response.output_text.delta..., response.output_text.done,
                    response.content_part.done
      reasoning:    response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                    response.content_part.done
      a call:       response.function_call_arguments.delta..., response.function_call_arguments.done
    response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

`response()` is the response object as it stands (the body of a non-streamed answer, and what is
stored). Everything is a function of the inputs: ids are made from the response's id and the
item's place, so a gateway that takes over a background response and feeds it the same events
again builds the same events, and can skip those already written.

Tool calls are read back from the text as the chat path reads them (gateway/tool_calls.py); under
a forced call (`required`, a named function) the text is never a message.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from ..errors import ApiError
from ..generation import Done
from ..tool_calls import Piece, ToolCall, ToolCallReader, ToolPlan

TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


class ResponseBuilder:
    def __init__(
        self, response_id: str, echo: dict[str, Any], plan: ToolPlan, created_at: float, logprobs: int | None = None
    ):
        self.id = response_id
        self.logprobs = logprobs  # alternatives per token, None: no logprobs
        self.echo = echo
        self.plan = plan
        self.created_at = created_at
        self.reader = ToolCallReader(plan)
        self.status = "in_progress"
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.completed_at: float | None = None
        self.sequence = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._held = ""  # whitespace before any message text: a message only if real text follows
        self._held_logprobs: list[dict[str, Any]] = []  # those of text not written yet
        self._suffix = response_id.removeprefix("resp_")

    # ------------------------------------------------------------ the object

    def response(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": self.incomplete,
            **self.echo,
            "output": copy.deepcopy(self.output),
            "usage": self.usage,
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _lifecycle(self, kind: str) -> dict[str, Any]:
        return self._event(kind, response=self.response())

    # ------------------------------------------------------------ stages

    def start(self, queued: bool = False) -> list[dict[str, Any]]:
        """The opening events: `queued` for a background response no worker has taken yet."""
        self.status = "queued" if queued else "in_progress"
        return [
            self._lifecycle("response.created"),
            self._lifecycle("response.queued" if queued else "response.in_progress"),
        ]

    def begin(self) -> list[dict[str, Any]]:
        """A queued response that a worker took."""
        if self.status != "queued":
            return []
        self.status = "in_progress"
        return [self._lifecycle("response.in_progress")]

    def feed(
        self, text: str, reasoning: str = "", logprobs: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """One delta: its answer text, its reasoning text, its tokens' logprobs (protocol `delta`)."""
        events = self.begin()
        if self.logprobs is not None and logprobs:
            self._held_logprobs += [_logprob(entry, self.logprobs) for entry in logprobs]
        if reasoning:
            events += self._reasoning(reasoning)
        if text:
            events += self._piece(self.reader.feed(text))
        return events

    def finish(self, done: Done) -> list[dict[str, Any]]:
        events = self.begin() + self._piece(self.reader.finish())
        cut = done.finish_reason == "length" and not self.reader.forced_done
        events += self._close("incomplete" if cut else "completed")
        usage = done.usage
        self.usage = {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        }
        self.completed_at = time.time()
        if cut:
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            return events + [self._lifecycle("response.incomplete")]
        self.status = "completed"
        return events + [self._lifecycle("response.completed")]

    def fail(self, error: ApiError) -> list[dict[str, Any]]:
        events = self._close("incomplete")
        self.status = "failed"
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        self.error = {"code": code, "message": error.message}
        return events + [self._lifecycle("response.failed")]

    def cancel(self) -> None:
        """A background response cancelled: what it wrote stays, unfinished."""
        self._close("incomplete")
        self.status = "cancelled"

    # ------------------------------------------------------------ items

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close("completed")
            item = {
                "id": f"rs_{self._suffix}_{len(self.output)}",
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            events += self._add(item)
            events.append(self._part_added({"type": "reasoning_text", "text": ""}))
        self._open["content"][0]["text"] += text
        events.append(self._item_event("response.reasoning_text.delta", content_index=0, delta=text))
        return events

    def _piece(self, piece: Piece) -> list[dict[str, Any]]:
        events = self._text(piece.text) if piece.text else []
        for call in piece.started:
            events += self._call(call)
        if self.plan.mode == "named":
            for _, text in piece.arguments:
                self._open["arguments"] += text
                events.append(self._item_event("response.function_call_arguments.delta", delta=text))
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != "message":
            if not (self._held + text).strip():
                self._held += text
                return []
            text, self._held = self._held + text, ""
            events += self._close("completed")
            item = {
                "id": f"msg_{self._suffix}_{len(self.output)}",
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            events += self._add(item)
            events.append(self._part_added({"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        part, logprobs, self._held_logprobs = self._open["content"][0], self._held_logprobs, []
        part["text"] += text
        part["logprobs"] += logprobs
        events.append(self._item_event("response.output_text.delta", content_index=0, delta=text, logprobs=logprobs))
        return events

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        events = self._close("completed")
        index = len(self.output)
        item = {
            "id": f"fc_{self._suffix}_{index}",
            "type": "function_call",
            "status": "in_progress",
            "call_id": f"call_{self._suffix}_{index}",
            "name": call.name,
            "arguments": "",
        }
        events += self._add(item)
        if self.plan.mode != "named":  # a whole call, read from its tags
            item["arguments"] = call.arguments
            events.append(self._item_event("response.function_call_arguments.delta", delta=call.arguments))
            events += self._close("completed")
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item))]

    def _part_added(self, part: dict[str, Any]) -> dict[str, Any]:
        self._open["content"].append(part)
        return self._item_event("response.content_part.added", content_index=0, part=copy.deepcopy(part))

    def _item_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return self._event(kind, item_id=self._open["id"], output_index=len(self.output) - 1, **fields)

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, events = self._open, []
        if item is None:
            return events
        if item["type"] == "function_call":
            events.append(
                self._item_event(
                    "response.function_call_arguments.done", arguments=item["arguments"], name=item["name"]
                )
            )
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            events.append(self._item_event(kind, content_index=0, text=part["text"], **extra))
            events.append(self._item_event("response.content_part.done", content_index=0, part=copy.deepcopy(part)))
        item["status"] = status
        events.append(
            self._event("response.output_item.done", output_index=len(self.output) - 1, item=copy.deepcopy(item))
        )
        self._open = None
        return events


def _logprob(entry: dict[str, Any], top: int) -> dict[str, Any]:
    """A token's logprob (protocol `{token, bytes, logprob, top}`) in the Responses shape."""

    def one(alternative: dict[str, Any]) -> dict[str, Any]:
        return {"token": alternative["token"], "bytes": list(alternative["bytes"]), "logprob": alternative["logprob"]}

    return one(entry) | {"top_logprobs": [one(alternative) for alternative in entry.get("top", [])[:top]]}
