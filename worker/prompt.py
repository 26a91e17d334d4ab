"""From a request's input (chat messages, prompt text or token ids) to the prompt's token ids.

A prompt that leaves no room for `max_tokens` within the model's context is an error, unless the
request asks to truncate: then the oldest tokens go, chat structure intact (the oldest non-system
messages are dropped first, then the oldest remaining message content is cut from its start).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker.chat_render import render_chat

if TYPE_CHECKING:
    from worker.model.loader import LoadedModel


class PromptTooLong(ValueError):
    """The prompt (with room for the answer) cannot fit in the model's context or the KV cache."""


def build_prompt_ids(
    model: LoadedModel,
    *,
    messages: list[dict[str, Any]] | None = None,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    max_tokens: int,
    truncate: bool,
    tools: list[dict[str, Any]] | None = None,
    continue_final: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    context = model.config.max_context
    limit = context - max_tokens
    if limit < 1:
        raise PromptTooLong(
            f"max_tokens {max_tokens} leaves no room for a prompt in the model's context of {context} tokens"
        )
    if messages is not None:
        render = functools.partial(_render, tools=tools, continue_final=continue_final, template_kwargs=template_kwargs)
        ids = render(model, messages)
        if len(ids) > limit and truncate:
            ids = _truncate_messages(model, messages, limit, render)
    elif prompt is not None:
        ids = model.tokenizer.encode(prompt, add_special_tokens=True).ids
    elif prompt_ids is not None:
        ids = _checked_ids(prompt_ids, model.config.vocab_size)
    else:
        raise ValueError("give messages, prompt or prompt_ids")
    if len(ids) > limit and truncate:
        ids = ids[-limit:]
    if len(ids) > limit:
        raise PromptTooLong(
            f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: together "
            f"{len(ids) + max_tokens}, more than the model's context of {context} tokens"
        )
    if not ids:
        if model.bos_token_id is None:
            raise ValueError("the prompt is empty")
        ids = [model.bos_token_id]
    return ids


def _render(
    model: LoadedModel,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    continue_final: bool,
    template_kwargs: dict[str, Any] | None,
) -> list[int]:
    text = render_chat(model, messages, tools, continue_final, template_kwargs)
    return model.tokenizer.encode(text, add_special_tokens=False).ids


Render = Callable[["LoadedModel", list[dict[str, Any]]], list[int]]


def _checked_ids(ids: list[int], vocab_size: int) -> list[int]:
    bad = [token for token in ids if not 0 <= token < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids holds token ids outside the vocabulary of {vocab_size}: {bad[:5]}")
    return list(ids)


def _truncate_messages(model: LoadedModel, messages: list[dict[str, Any]], limit: int, render: Render) -> list[int]:
    """Drop the oldest non-system messages (keeping the last one), then cut message contents from the left."""
    messages = [dict(message) for message in messages]
    while len(render(model, messages)) > limit and _oldest_droppable(messages) is not None:
        del messages[_oldest_droppable(messages)]
    for index in _cut_order(messages):
        ids = _cut_content(model, messages, index, limit, render)
        if len(ids) <= limit:
            return ids
    return render(model, messages)


def _oldest_droppable(messages: list[dict[str, Any]]) -> int | None:
    candidates = [i for i, message in enumerate(messages) if message.get("role") != "system"]
    return candidates[0] if len(candidates) > 1 else None


def _cut_order(messages: list[dict[str, Any]]) -> list[int]:
    """Non-system messages first (oldest first), system messages last."""
    others = [i for i, message in enumerate(messages) if message.get("role") != "system"]
    systems = [i for i, message in enumerate(messages) if message.get("role") == "system"]
    return others + systems


def _cut_content(
    model: LoadedModel, messages: list[dict[str, Any]], index: int, limit: int, render: Render
) -> list[int]:
    """Keep only the most recent tokens of messages[index]'s content so the render fits, if it can."""
    tokenizer = model.tokenizer
    content_ids = tokenizer.encode(str(messages[index].get("content", "")), add_special_tokens=False).ids
    ids = render(model, messages)
    keep = len(content_ids) - (len(ids) - limit)
    while len(ids) > limit and content_ids:
        keep = max(0, min(keep, len(content_ids) - 1))
        content_ids = content_ids[len(content_ids) - keep :]
        messages[index]["content"] = tokenizer.decode(content_ids)
        ids = render(model, messages)
        keep -= len(ids) - limit
    return ids
