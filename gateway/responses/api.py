"""The handlers: POST /v1/responses (whole, streamed, or in the background), GET / DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel,
POST /v1/responses/input_tokens.

A request reads as the chat path's: check the body (params.py), build one protocol request from
the conversation (the stored one continued, for previous_response_id), wait for a worker to admit
it, then answer with the response object or its stream of events (builder.py). With `store` (the
API's default) the finished response is kept, owned by the caller's key (store.py); a background
response is kept from the start and run by the gateways' runners (background.py).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from typing import Any

from aiohttp import web

import protocol

from .. import sse
from ..auth import owner_of
from ..context import Gateway, gateway_of
from ..errors import ApiError, openai_error_body
from ..generation import Delta, Generation, new_request
from ..leased_drivers import LeasedDrivers
from ..validate import read_json_object
from .background import enqueue, withdraw
from .builder import TERMINAL_EVENTS, ResponseBuilder
from .conversation import input_messages, listed_items, output_messages
from .params import ResponseParams, parse_count, parse_request
from .store import ResponseStore, new_id

API = "responses"  # in metrics


@dataclasses.dataclass
class Responses:
    store: ResponseStore
    runner: LeasedDrivers  # background.py's


RESPONSES = web.AppKey("responses", Responses)


def responses_of(request: web.Request) -> Responses:
    return request.app[RESPONSES]


@dataclasses.dataclass
class Turn:
    """One response being made: its checked request, its builder, its owner, and the conversation
    it continues (the stored history and this request's input; its own output is added when kept)."""

    params: ResponseParams
    builder: ResponseBuilder
    owner: str
    conversation: list[dict[str, Any]]

    async def keep(self, store: ResponseStore) -> None:
        """Store the ended response, with `store` (the API's default)."""
        if self.params.store:
            builder = self.builder
            history = self.conversation + output_messages(builder.output)
            fields = {"owner": self.owner, "state": builder.status, "response": builder.response(), "history": history}
            await store.save(builder.id, fields | {"input": listed_items(self.params.input, builder.id)})


# ---------------------------------------------------------------- POST /v1/responses


async def create(request: web.Request) -> web.StreamResponse:
    gateway, responses = gateway_of(request), responses_of(request)
    params = parse_request(await read_json_object(request), gateway.config)
    model = await gateway.models.require(params.model)
    owner = owner_of(request)
    history = await _history(responses.store, params.previous_response_id, owner)
    response_id = new_id()
    work = new_request(
        gateway, response_id, model, params.sampling,
        messages=params.messages(history), tools=params.plan.tools, constraint=params.constraint,
        truncate=params.truncate, logprobs=params.logprobs, **params.thinking,
    )  # fmt: skip
    builder = ResponseBuilder(response_id, params.echo | {"model": model}, params.plan, time.time(), params.logprobs)
    turn = Turn(params, builder, owner, history + input_messages(params.input))
    if params.background:
        await _start_background(gateway, responses, work, turn)
        if not params.stream:
            return web.json_response(builder.response())
        return await sse.relay_in_stream(
            request,
            lambda response: follow(response, responses.store, response_id, -1, gateway),
            openai_error_body,
            gateway.metrics.errors,
        )
    async with Generation(gateway, work, API) as generation:
        if not params.stream:
            await _generate(generation, builder)
            await turn.keep(responses.store)
            return web.json_response(builder.response())
        await generation.admitted(gateway.config.admission_wait)
        keepalive = gateway.config.keepalive_seconds
        return await sse.relay_in_stream(
            request,
            lambda response: _relay(response, generation, turn, responses.store, keepalive),
            openai_error_body,
            gateway.metrics.errors,
        )


async def _history(store: ResponseStore, previous: str | None, owner: str) -> list[dict[str, Any]]:
    """The stored conversation a request continues: the earlier turns' input and output, without
    their instructions (as OpenAI carries them over)."""
    if previous is None:
        return []
    record = await store.get(previous, owner)
    if record is None:
        raise ApiError(
            404, f"previous_response_id: no response {previous!r} (or it was not stored)", param="previous_response_id"
        )
    if record.get("state") == "running":
        raise invalid_state(previous, "is still running; continue it once it has ended")
    return json.loads(record.get("history") or "[]")


def invalid_state(response_id: str, problem: str) -> ApiError:
    return ApiError(400, f"response {response_id} {problem}", param="response_id")


async def _generate(generation: Generation, builder: ResponseBuilder) -> None:
    builder.start()
    async for event in generation.events():
        if isinstance(event, Delta):
            builder.feed(event.text, event.reasoning, event.logprobs)
        elif event is not None:
            builder.finish(event)


async def _relay(
    response: web.StreamResponse, generation: Generation, turn: Turn, store: ResponseStore, keepalive: float
) -> None:
    """The events as they come; a worker's error after the first is the response's `failed` end."""
    builder = turn.builder
    for event in builder.start():
        await _send(response, event)
    try:
        async for item in generation.events(keepalive):
            if item is None:
                await sse.send_comment(response, "waiting")
                continue
            if isinstance(item, Delta):
                events = builder.feed(item.text, item.reasoning, item.logprobs)
            else:
                events = builder.finish(item)
            for event in events:
                await _send(response, event)
    except ApiError as error:
        for event in builder.fail(error):
            await _send(response, event)
    await turn.keep(store)


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await sse.send(response, event, event=event["type"])


async def _start_background(gateway: Gateway, responses: Responses, work: protocol.Request, turn: Turn) -> None:
    """Store the queued response with its request (events to a durable reply stream), enqueue it,
    and wake this gateway's runner to drive it. A full queue for the model is a 429, as for a live
    request; a full share of it for the key is not: the response waits for a place (background.py)."""
    if await gateway.queue.waiting(work.model) >= gateway.config.max_queue:
        raise ApiError(
            429,
            f"the queue for {work.model} is full; retry later",
            code="overloaded",
            retry_after=gateway.config.retry_after,
        )
    store, builder, token = responses.store, turn.builder, secrets.token_hex(16)
    work = dataclasses.replace(
        work,
        reply=protocol.Reply("stream", store.reply_stream(builder.id)),
        cancel_digest=protocol.cancel_digest(token),
    )
    builder.start(queued=True)
    record = {
        "owner": turn.owner, "state": "running", "background": "1", "model": work.model, "msg": work.encode(),
        "cancel_token": token, "deadline": repr(work.deadline), "created_at": repr(builder.created_at),
        "echo": builder.echo, "plan": dataclasses.asdict(turn.params.plan), "response": builder.response(),
        "history": turn.conversation, "input": listed_items(turn.params.input, builder.id),
        "logprobs": turn.params.logprobs,
    }  # fmt: skip
    await store.save(builder.id, record, active=True)
    await enqueue(gateway, store, builder.id, record)  # or, its key's queue share full, by its driver later
    responses.runner.wake()


# ---------------------------------------------------------------- GET, DELETE, cancel


async def _owned(request: web.Request) -> tuple[str, dict[str, str]]:
    response_id = request.match_info["response_id"]
    record = await responses_of(request).store.get(response_id, owner_of(request))
    if record is None:
        raise ApiError(404, f"no response {response_id!r}", param="response_id", code="not_found")
    return response_id, record


def view(record: dict[str, str]) -> dict[str, Any]:
    """The response object as stored; a running one whose cancel its driver has not reached yet is
    already `cancelled`."""
    body = json.loads(record["response"])
    if record.get("state") == "running" and record.get("cancel"):
        body["status"] = "cancelled"
    return body


async def retrieve(request: web.Request) -> web.StreamResponse:
    response_id, record = await _owned(request)
    if request.query.get("stream", "false").lower() != "true":
        return web.json_response(view(record))
    if not record.get("background"):
        raise invalid_state(response_id, "was not created with `background: true`: only those can be streamed again")
    after = _starting_after(request)
    gateway = gateway_of(request)
    return await sse.relay_in_stream(
        request,
        lambda response: follow(response, responses_of(request).store, response_id, after, gateway),
        openai_error_body,
        gateway.metrics.errors,
    )


def _starting_after(request: web.Request) -> int:
    text = request.query.get("starting_after")
    if text is None:
        return -1
    if not text.isdigit():
        raise ApiError(400, "starting_after: must be a sequence number (a whole number)", param="starting_after")
    return int(text)


async def follow(
    response: web.StreamResponse, store: ResponseStore, response_id: str, after: int, gateway: Gateway
) -> None:
    """A background response's events after `after`, as they are written, until its end."""
    block_ms = int(gateway.config.keepalive_seconds * 1000)
    while True:
        events = await store.events(response_id, after, block_ms)
        if not events:
            record = await store.record(response_id)
            if record is None or record.get("state") != "running":
                events = await store.events(response_id, after, None)  # written just before it ended
                if not events:
                    return
            else:
                await sse.send_comment(response, "waiting")
        for event in events:
            await _send(response, event)
            after = event["sequence_number"]
            if event["type"] in TERMINAL_EVENTS:
                return


async def delete(request: web.Request) -> web.Response:
    response_id, record = await _owned(request)
    store = responses_of(request).store
    await store.delete(response_id)
    if record.get("state") == "running":
        await withdraw(store, response_id, record)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel(request: web.Request) -> web.Response:
    response_id, record = await _owned(request)
    if not record.get("background"):
        raise invalid_state(response_id, "was not created with `background: true`: only those can be cancelled")
    responses = responses_of(request)
    state = await responses.store.cancel(response_id)
    if state != "cancelled":
        raise invalid_state(
            response_id, f"has already ended ({state}): only a queued or running response can be cancelled"
        )
    await withdraw(responses.store, response_id, await responses.store.record(response_id))
    responses.runner.wake()
    return web.json_response(view(await responses.store.record(response_id) or record))


async def input_items(request: web.Request) -> web.Response:
    """The response's input items, a page at a time (`limit` 1-100, default 20; `order` desc by
    default, as OpenAI lists them; `after` an item id)."""
    _, record = await _owned(request)
    items = json.loads(record.get("input") or "[]")
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, 'order: must be "asc" or "desc"', param="order")
    if order == "desc":
        items.reverse()
    after = request.query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(404, f"after: no input item {after!r}", param="after")
        items = items[ids.index(after) + 1 :]
    limit = page_limit(request)
    page = items[:limit]
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


def page_limit(request: web.Request) -> int:
    text = request.query.get("limit", "20")
    if not text.isdigit() or not 1 <= int(text) <= 100:
        raise ApiError(400, "limit: must be a whole number from 1 to 100", param="limit")
    return int(text)


# ---------------------------------------------------------------- POST /v1/responses/input_tokens


async def input_tokens(request: web.Request) -> web.Response:
    """Asks a worker (which has the model's tokenizer and chat template) to tokenize the prompt the
    request would make: a `tokenize` task, nothing generated."""
    gateway = gateway_of(request)
    params = parse_count(await read_json_object(request))
    model = await gateway.models.require(params.model)
    history = await _history(responses_of(request).store, params.previous_response_id, owner_of(request))
    work = new_request(
        gateway, f"count_{secrets.token_hex(12)}", model, params.sampling,
        messages=params.messages(history), tools=params.plan.tools, truncate=params.truncate, task="tokenize",
        **params.thinking,
    )  # fmt: skip
    async with Generation(gateway, work, "input_tokens", timed=False) as generation:
        _, done = await generation.result()
    return web.json_response({"object": "response.input_tokens", "input_tokens": done.usage.prompt_tokens})
