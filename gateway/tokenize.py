"""POST /tokenize and /detokenize, in vLLM's and llama.cpp's shapes, answered by a worker of the model.

/tokenize takes `prompt` (vLLM) or `content` (llama.cpp) text, or chat `messages` (rendered with the
model's template and a generation prompt, as a request would be); it answers `count`, `tokens`,
`max_model_len`, and the tokens' text in `token_strs` (vLLM's `return_token_strs`) or as
`[{id, piece}]` (llama.cpp's `with_pieces`). /detokenize takes `tokens` and answers the text as
`prompt` (vLLM) and `content` (llama.cpp).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

import protocol

from .context import Gateway, gateway_of
from .generation import Done, Generation, new_request, new_request_id
from .openai import parse_messages
from .validate import invalid, optional_bool, read_json_object, refuse_unknown

TOKENIZE_PARAMS = {
    "model",
    "prompt",
    "content",
    "messages",
    "add_special_tokens",
    "add_special",
    "add_generation_prompt",
    "return_token_strs",
    "with_pieces",
}
DETOKENIZE_PARAMS = {"model", "tokens"}


async def tokenize(request: web.Request) -> web.Response:
    gateway = gateway_of(request)
    body = await read_json_object(request)
    refuse_unknown(body, TOKENIZE_PARAMS)
    done = await _ask(gateway, await _model(gateway, body), _tokenize_input(body), "tokenize")
    ids, pieces = done.extra.get("prompt_ids", []), done.extra.get("pieces", [])
    answer: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": done.extra.get("max_context"),
        "tokens": ids,
        "token_strs": None,
    }
    if optional_bool(body, "return_token_strs"):
        answer["token_strs"] = pieces
    if optional_bool(body, "with_pieces"):
        answer["tokens"] = [{"id": token, "piece": piece} for token, piece in zip(ids, pieces)]
    return web.json_response(answer)


async def detokenize(request: web.Request) -> web.Response:
    gateway = gateway_of(request)
    body = await read_json_object(request)
    refuse_unknown(body, DETOKENIZE_PARAMS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise invalid("tokens", "must be a list of token ids")
    done = await _ask(gateway, await _model(gateway, body), {"prompt_ids": tokens}, "detokenize")
    text = done.extra.get("text", "")
    return web.json_response({"prompt": text, "content": text})


def _tokenize_input(body: dict[str, Any]) -> dict[str, Any]:
    for name in ("add_special_tokens", "add_special", "add_generation_prompt"):
        if optional_bool(body, name) is False:
            raise invalid(
                name, "only true is supported (text gets the model's special tokens, messages a generation prompt)"
            )
    if body.get("messages") is not None:
        return {"messages": parse_messages(body)}
    text = body.get("prompt", body.get("content"))
    if not isinstance(text, str):
        raise invalid("prompt", "give `prompt` (or `content`) text, or chat `messages`")
    return {"prompt": text}


async def _model(gateway: Gateway, body: dict[str, Any]) -> str:
    """The model named, or the only one served when none is."""
    name = body.get("model")
    if name is None:
        served = sorted(await gateway.models.served(fresh=True))
        if len(served) != 1:
            raise invalid("model", f"is required when more than one model is served ({', '.join(served) or 'none'})")
        return served[0]
    if not isinstance(name, str):
        raise invalid("model", "must be a string")
    return await gateway.models.require(name)


async def _ask(gateway: Gateway, model: str, prompt: dict[str, Any], task: str) -> Done:
    work = new_request(
        gateway, new_request_id(f"{task}-"), model, protocol.SamplingParams(max_tokens=1), task=task, **prompt
    )
    async with Generation(gateway, work, task, timed=False) as generation:
        _, done = await generation.result()
    return done
