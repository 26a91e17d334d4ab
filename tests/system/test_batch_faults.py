"""A batch survives its gateway and a worker dying mid-way: real processes (tests/support/process_stack.py).

One Redis with its append-only file, two worker processes on the tiny model with slowed steps,
and `lmq gateway` processes. A batch of 50 items is created through one gateway; with some items
answered, a worker holding items is SIGKILLed and so is the gateway driving the batch. Another
gateway, started afterwards, takes the batch over when the dead one's lease runs out; a live worker
claims the dead one's entries. The batch completes with every custom_id answered exactly once, each
answer equal to an undisturbed run's (float32 greedy).
"""

from __future__ import annotations

import json
import signal
from collections import Counter

import openai
import pytest

import protocol
from lmq.redis_server import free_tcp_port
from protocol import REQUEST_GROUP
from protocol.keys import ACTIVE_BATCHES, batch_key
from tests.support.batch_files import jsonl, poll
from tests.support.process_stack import (
    GATEWAY_SETTINGS,
    LMQ,
    MODEL,
    Stack,
    StackSpec,
    _clean_environment,
    eventually,
    expected_answers,
)

pytestmark = pytest.mark.timeout(240)

ITEMS = 50
MAX_TOKENS = 8


def start_gateway(stack: Stack, **settings: str) -> str:
    """`lmq gateway` as Stack.start_gateway starts it, with batch settings of the test's own."""
    name = f"batch-gateway-{len(stack.processes.running)}"
    port = free_tcp_port()
    environment = {**_clean_environment(), **GATEWAY_SETTINGS, **settings, "REDIS_URL": stack.url, "PORT": str(port)}
    stack.processes.start(name, [str(LMQ), "gateway"], environment)
    stack.gateways.append(name)
    stack.gateway_urls[name] = f"http://127.0.0.1:{port}"
    return name


def line(index: int) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Item {index}: the quick brown fox"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    return {"custom_id": f"item-{index}", "method": "POST", "url": "/v1/chat/completions", "body": body}


@pytest.fixture
async def stack(tmp_path, tiny_model_dir):
    stack = Stack(StackSpec("valkey9", workers=2, gateways=0), tmp_path, tiny_model_dir)
    try:
        await stack.prepare()
        yield stack
    finally:
        stack.close()


async def test_a_batch_completes_exactly_once_across_a_worker_and_a_gateway_killed_mid_way(stack, tiny):
    expected = await expected_answers(
        tiny, [line(i)["body"]["messages"][0]["content"] for i in range(ITEMS)], MAX_TOKENS
    )
    first = start_gateway(stack, LMQ_BATCH_IN_FLIGHT="8")
    await stack.wait_ready()
    client = openai.AsyncOpenAI(base_url=stack.gateway_urls[first] + "/v1", api_key="unused", max_retries=0)
    upload = await client.files.create(file=("items.jsonl", jsonl([line(i) for i in range(ITEMS)])), purpose="batch")
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    async def some_answered():
        counts = (await client.batches.retrieve(batch.id)).request_counts
        return counts.completed >= 10

    await poll(some_answered, what="10 answered items")
    holders = stack.admin.xpending_range(
        protocol.request_stream(MODEL, "batch"), REQUEST_GROUP, min="-", max="+", count=100
    )
    victim = holders[0]["consumer"].decode()
    stack.kill_worker(victim)
    stack.processes.signal(first, signal.SIGKILL)
    stack.gateways.remove(first)
    assert stack.admin.sismember(ACTIVE_BATCHES, batch.id), "the batch ended before the faults"

    second = start_gateway(stack, LMQ_BATCH_IN_FLIGHT="8")
    await stack.wait_ready()
    client = openai.AsyncOpenAI(base_url=stack.gateway_urls[second] + "/v1", api_key="unused", max_retries=0)

    async def completed():
        found = await client.batches.retrieve(batch.id)
        return found if found.status in ("completed", "failed", "cancelled", "expired") else None

    done = await poll(completed, what="the batch to complete on the second gateway", timeout=150)
    assert done.status == "completed", f"{done}\n{stack.log_tails()}"
    assert (done.request_counts.completed, done.request_counts.failed) == (ITEMS, 0)
    lines = [json.loads(raw) for raw in (await client.files.content(done.output_file_id)).text.splitlines()]
    assert Counter(answer["custom_id"] for answer in lines) == Counter(f"item-{i}" for i in range(ITEMS))
    for answer in lines:
        index = int(answer["custom_id"].removeprefix("item-"))
        prompt = line(index)["body"]["messages"][0]["content"]
        body = answer["response"]["body"]
        assert body["choices"][0]["message"]["content"] == expected[prompt].text, (
            f"{answer['custom_id']}: not the undisturbed answer"
        )
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
    await eventually(
        lambda: stack.admin.xlen(protocol.request_stream(MODEL, "batch")) == 0, "an empty batch stream", 10, stack
    )
    assert not stack.admin.exists(batch_key(batch.id, "inflight"))
    assert f"driving batch {batch.id}" in stack.processes.log_text(second)  # the second gateway took it over
