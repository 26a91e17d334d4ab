"""Requests answered without generating: `tokenize` (the prompt's token ids, as the model would read them)
and `detokenize` (token ids back to text). One `done` event each, with finish_reason `tokenized` /
`detokenized`; the gateway's /tokenize and /detokenize endpoints are built on them.

A tokenize answer holds every token's id and text, so it is bounded: at most MAX_TOKENIZE_TOKENS
tokens (else a `too_large` error, HTTP 413 at the gateway), and like every event it must fit in one
message (worker/publisher.py replaces one that does not with a `too_large` error)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from protocol import ProtocolError, Request, done_event
from worker.chat_render import render_chat
from worker.logprob_events import token_string
from worker.token_bytes import token_bytes

if TYPE_CHECKING:
    from worker.model.loader import LoadedModel

MAX_TOKENIZE_TOKENS = 65536


def answer_task(model: LoadedModel, request: Request) -> dict[str, Any]:
    if request.task == "tokenize":
        ids = _tokenize(model, request)
        if len(ids) > MAX_TOKENIZE_TOKENS:
            raise ProtocolError(
                "too_large", f"the input is {len(ids)} tokens; tokenize answers at most {MAX_TOKENIZE_TOKENS}"
            )
        table = token_bytes(model.tokenizer)
        pieces = [token_string(table[i]) if i < len(table) else "" for i in ids]
        return done_event(
            request.id,
            0,
            "tokenized",
            len(ids),
            0,
            0,
            prompt_ids=ids,
            pieces=pieces,
            max_context=model.config.max_context,
        )
    ids = _checked(model, request.prompt_ids or [])
    text = model.tokenizer.decode(ids, skip_special_tokens=False)
    return done_event(request.id, 0, "detokenized", len(ids), 0, 0, text=text)


def _tokenize(model: LoadedModel, request: Request) -> list[int]:
    if request.messages is not None:
        text = render_chat(model, request.messages, request.tools, request.continue_final, request.template_kwargs)
        return model.tokenizer.encode(text, add_special_tokens=False).ids
    if request.prompt is not None:
        return model.tokenizer.encode(request.prompt, add_special_tokens=True).ids
    return _checked(model, request.prompt_ids or [])


def _checked(model: LoadedModel, ids: list[int]) -> list[int]:
    bad = [token for token in ids if token >= model.config.vocab_size]
    if bad:
        raise ValueError(f"token ids outside the vocabulary of {model.config.vocab_size}: {bad[:5]}")
    return ids
