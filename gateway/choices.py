"""The choices of one OpenAI request: `n` generations of each of its prompts, read as one answer.

Each choice is a protocol request of its own (`<id>-<index>`, seed + index when seeded), enqueued
together: a worker that reads them together prefills the shared prompt once and the others find
its pages in the prefix cache. Every fault guarantee of a single request holds for each choice.
With n = 1 the request keeps its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import protocol

from .context import Gateway
from .generation import Delta, Done, Generation, Usage, duplicate

SEED_RANGE = 1 << 64


def choice_requests(prompts: list[protocol.Request], n: int) -> list[protocol.Request]:
    """`n` choices of each prompt's request (all with the request's id), indexed as OpenAI does: prompt × n + choice."""
    if len(prompts) == 1 and n == 1:
        return prompts

    def choice(request: protocol.Request, index: int) -> protocol.Request:
        seed = request.sampling.seed
        sampling = (
            request.sampling
            if seed is None
            else dataclasses.replace(request.sampling, seed=(seed + index) % SEED_RANGE)
        )
        return dataclasses.replace(request, id=f"{request.id}-{index}", sampling=sampling)

    return [choice(request, p * n + c) for p, request in enumerate(prompts) for c in range(n)]


def total_usage(dones: list[Done], n: int) -> Usage:
    """As OpenAI counts: each prompt once (the first of its `n` choices, in index order), every choice's completion tokens."""
    firsts = [done.usage for done in dones[::n]]
    completion = sum(done.usage.completion_tokens for done in dones)
    reasoning = sum(done.usage.reasoning_tokens for done in dones)
    return Usage(sum(u.prompt_tokens for u in firsts), completion, sum(u.cached_tokens for u in firsts), reasoning)


class Choices:
    def __init__(self, gateway: Gateway, requests: list[protocol.Request], api: str):
        """Every choice's id is checked before any is enqueued: a reused id is a 409 with nothing sent.
        (The choices are entered one by one; the router's own refusal catches an id taken meanwhile.)"""
        if any(gateway.replies.is_open(request.id) for request in requests):
            raise duplicate()
        # Each choice's events come on its own id's reply address (on a cluster, its shard's channel).
        requests = [dataclasses.replace(request, reply=gateway.replies.reply_for(request.id)) for request in requests]
        self.generations = [Generation(gateway, request, api) for request in requests]
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Choices:
        async with contextlib.AsyncExitStack() as stack:
            for generation in self.generations:
                await stack.enter_async_context(generation)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stack.__aexit__(exc_type, exc, tb)

    @property
    def prompt_tokens(self) -> int:
        return self.generations[0].prompt_tokens

    async def admitted(self, wait: float) -> bool:
        """True once a worker admitted every choice within `wait` seconds; a refusal raises its ApiError."""
        results = await asyncio.gather(*(generation.admitted(wait) for generation in self.generations))
        return all(results)

    async def results(self) -> list[tuple[str, list[dict[str, Any]], Done]]:
        return list(await asyncio.gather(*(generation.result_with_logprobs() for generation in self.generations)))

    async def events(self, keepalive: float) -> AsyncIterator[tuple[int, Delta | Done] | None]:
        """Every choice's events as (index, event), merged as they come; None after `keepalive` idle seconds."""
        if len(self.generations) == 1:
            async for event in self.generations[0].events(keepalive):
                yield None if event is None else (0, event)
            return
        queue: asyncio.Queue[tuple[int, Delta | Done] | BaseException] = asyncio.Queue()
        tasks = [
            asyncio.create_task(self._forward(index, generation, queue))
            for index, generation in enumerate(self.generations)
        ]
        try:
            remaining = len(tasks)
            while remaining:
                try:
                    item = await asyncio.wait_for(queue.get(), keepalive)
                except TimeoutError:
                    yield None
                    continue
                if isinstance(item, BaseException):
                    raise item
                remaining -= isinstance(item[1], Done)
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    async def _forward(index: int, generation: Generation, queue: asyncio.Queue) -> None:
        try:
            async for event in generation.events():
                queue.put_nowait((index, event))
        except Exception as error:
            queue.put_nowait(error)
