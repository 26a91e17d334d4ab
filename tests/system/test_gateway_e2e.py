"""Gateways and real workers together: cancellation frees pages; answers reach the client that asked."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import openai

from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway
from tests.support.worker_harness import wait_for
from tests.support.worker_process import SlowModel


def finished(worker, outcome: str) -> float:
    return worker.metrics.finished.labels(worker.model_name, outcome)._value.get()


async def test_a_client_leaving_mid_stream_frees_the_workers_pages(redis_url, tiny):
    slowed = dataclasses.replace(
        tiny, model=SlowModel(tiny.model, 0.1)
    )  # 240 tokens take 24 s at least: the client leaves long before
    body = {
        "model": REAL_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 240,
        "ignore_eos": True,
        "stream": True,
    }
    async with real_worker(redis_url, slowed) as worker, running_gateway(redis_url) as url:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/chat/completions", json=body) as response:
                async for line in response.content:
                    if b'"content":"' in line and b'"content":""' not in line:
                        break  # the first token arrived: leave
                assert worker.engine.stats.kv_pages_used > 0

        async def cancelled() -> bool:
            return not worker.engine.stats.running and finished(worker, "cancelled") >= 1

        await wait_for(cancelled, what="the worker to cancel the request the client left")
        assert worker.engine.stats.kv_pages_used == 0
        assert finished(worker, "length") == 0  # it did not run to the end


async def test_two_gateways_and_two_workers_answer_every_client(redis_url, tiny):
    async with (
        real_worker(redis_url, tiny, "w1", max_seqs=2) as first,
        real_worker(redis_url, tiny, "w2", max_seqs=2) as second,
        running_gateway(redis_url) as url_a,
        running_gateway(redis_url) as url_b,
    ):
        clients = [openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) for url in (url_a, url_b)]

        async def ask(i: int) -> int:
            client = clients[i % 2]
            messages = [{"role": "user", "content": f"Count to {i}"}]
            if i % 3 == 0:
                stream = await client.chat.completions.create(
                    model=REAL_MODEL,
                    messages=messages,
                    max_tokens=2 + i,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                return [chunk async for chunk in stream][-1].usage.completion_tokens
            answer = await client.chat.completions.create(
                model=REAL_MODEL, messages=messages, max_tokens=2 + i, extra_body={"ignore_eos": True}
            )
            return answer.usage.completion_tokens

        counts = await asyncio.gather(*(ask(i) for i in range(10)))
        served = [finished(worker, "length") for worker in (first, second)]
    assert counts == [2 + i for i in range(10)]  # each client got the answer to its own request
    assert sum(served) == 10
