"""A background response survives the gateway driving it being SIGKILLed: real processes
(tests/support/process_stack.py: Redis with its append-only file, a worker process on the tiny model
with slowed steps, `lmq gateway` processes).

A background response is created through one gateway; once some of its events are written, that
gateway is killed (no lease released). Another gateway, started afterwards, takes the response
over when the lease runs out, rebuilds its events from the worker's reply stream and writes the
rest: the response ends with the undisturbed answer (float32 greedy), and its event stream read
again holds every sequence number once.
"""

from __future__ import annotations

import signal

import openai
import pytest

from lmq.redis_server import free_tcp_port
from tests.support.batch_files import poll
from tests.support.process_stack import (
    GATEWAY_SETTINGS,
    LMQ,
    MODEL,
    Stack,
    StackSpec,
    _clean_environment,
    expected_answers,
)

pytestmark = pytest.mark.timeout(240)

PROMPT = "Tell me about the quick brown fox"
MAX_TOKENS = 24


def start_gateway(stack: Stack) -> str:
    name = f"responses-gateway-{len(stack.processes.running)}"
    port = free_tcp_port()
    environment = {**_clean_environment(), **GATEWAY_SETTINGS, "REDIS_URL": stack.url, "PORT": str(port)}
    stack.processes.start(name, [str(LMQ), "gateway"], environment)
    stack.gateways.append(name)
    stack.gateway_urls[name] = f"http://127.0.0.1:{port}"
    return name


def client(stack: Stack, gateway: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.gateway_urls[gateway] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
async def stack(tmp_path, tiny_model_dir):
    stack = Stack(StackSpec("valkey9", workers=1, gateways=0), tmp_path, tiny_model_dir)
    try:
        await stack.prepare()
        yield stack
    finally:
        stack.close()


async def test_a_background_response_ends_once_after_its_gateway_is_killed(stack, tiny):
    expected = (await expected_answers(tiny, [PROMPT], MAX_TOKENS))[PROMPT]
    first = start_gateway(stack)
    await stack.wait_ready()
    queued = await client(stack, first).responses.create(
        model=MODEL, input=PROMPT, background=True, max_output_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip

    async def some_written() -> bool:
        return stack.admin.xlen(f"lmq:response:{queued.id}:events") >= 8

    await poll(some_written, what="the first deltas", interval=0.05)
    stack.processes.signal(first, signal.SIGKILL)
    stack.gateways.remove(first)
    assert stack.admin.sismember("lmq:responses-active", queued.id), "the response ended before the fault"

    second = start_gateway(stack)
    await stack.wait_ready()
    later = client(stack, second)

    async def ended():
        found = await later.responses.retrieve(queued.id)
        return found if found.status not in ("queued", "in_progress") else None

    done = await poll(ended, what="the response's end on the second gateway", timeout=120)
    assert done.status == "incomplete" and done.usage.output_tokens == MAX_TOKENS, f"{done}\n{stack.log_tails()}"
    assert done.output_text == expected.text
    events = [event async for event in await later.responses.retrieve(queued.id, stream=True)]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == expected.text
    assert f"driving background response {queued.id}" in stack.processes.log_text(second)  # it took it over
