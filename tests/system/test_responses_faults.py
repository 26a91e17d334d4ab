"""A background response survives the gateway driving it being SIGKILLed, and a Sentinel failover
under it: real processes (tests/support/process_stack.py: Redis with its append-only file or a
Sentinel set, tests/support/sentinel_stack.py; a worker process on the tiny model with slowed
steps, `lmq gateway` processes).

A background response is created through one gateway; once some of its events are written, that
gateway is killed (no lease released). Another gateway, started afterwards, takes the response
over when the lease runs out, rebuilds its events from the worker's reply stream and writes the
rest: the response ends with the undisturbed answer (float32 greedy), and its event stream read
again holds every sequence number once.

Or, on a Sentinel set, the primary is SIGKILLed at that moment and the replica promoted: the
gateway driving the response keeps it through the outage and drives it on the promoted replica to
the same undisturbed end, its one driver from start to end.
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
    Expected,
    Stack,
    StackSpec,
    _clean_environment,
    expected_answers,
)
from tests.support.sentinel_stack import stack_on_sentinels

pytestmark = pytest.mark.timeout(240)

PROMPT = "Tell me about the quick brown fox"
MAX_TOKENS = 24
SOME_EVENTS = 8  # written to the response's event stream: the start and a few deltas, mid-answer


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


async def create_mid_answer(stack: Stack, sdk: openai.AsyncOpenAI):
    """A greedy background response of PROMPT, once SOME_EVENTS of its events are written."""
    queued = await sdk.responses.create(
        model=MODEL, input=PROMPT, background=True, max_output_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip

    async def some_written() -> bool:
        return stack.admin.xlen(f"lmq:response:{queued.id}:events") >= SOME_EVENTS

    await poll(some_written, what="the first deltas", interval=0.05)
    return queued


async def assert_ends_exactly(stack: Stack, sdk: openai.AsyncOpenAI, response_id: str, expected: Expected) -> None:
    """The response ends with the undisturbed answer, and its event stream read again holds every
    sequence number once and the same text."""

    async def ended():
        found = await sdk.responses.retrieve(response_id)
        return found if found.status not in ("queued", "in_progress") else None

    done = await poll(ended, what=f"the end of background response {response_id}", timeout=120)
    assert done.status == "incomplete" and done.usage.output_tokens == MAX_TOKENS, f"{done}\n{stack.log_tails()}"
    assert done.output_text == expected.text
    events = [event async for event in await sdk.responses.retrieve(response_id, stream=True)]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == expected.text


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
    queued = await create_mid_answer(stack, client(stack, first))
    stack.processes.signal(first, signal.SIGKILL)
    stack.gateways.remove(first)
    assert stack.admin.sismember("lmq:responses-active", queued.id), "the response ended before the fault"

    second = start_gateway(stack)
    await stack.wait_ready()
    await assert_ends_exactly(stack, client(stack, second), queued.id, expected)
    assert f"driving background response {queued.id}" in stack.processes.log_text(second)  # it took it over


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["redis6", "valkey9"])
async def test_a_background_response_ends_once_with_its_exact_text_across_a_sentinel_failover(
    kind, tmp_path, tiny_model_dir, tiny
):
    """The primary SIGKILLed mid-answer and the replica promoted: the gateway that drives the response
    rides the outage out (it keeps the lease, as after a Redis restart), and the response ends with the
    undisturbed answer, driven once from start to end."""
    expected = (await expected_answers(tiny, [PROMPT], MAX_TOKENS))[PROMPT]
    with stack_on_sentinels(tmp_path, kind, StackSpec("sentinel", workers=1, gateways=1), tiny_model_dir) as stack:
        sentinels = stack.topology.sentinels
        await stack.prepare()
        gateway = stack.gateways[0]
        sdk = client(stack, gateway)
        queued = await create_mid_answer(stack, sdk)
        sentinels.kill_primary()
        await sentinels.wait_failover()

        await assert_ends_exactly(stack, sdk, queued.id, expected)
        assert stack.admin.info("server")["tcp_port"] == sentinels.replica.port
        log = stack.processes.log_text(gateway)
        assert f"background response {queued.id}: redis unreachable" in log, "the response ended before the fault"
        assert log.count(f"driving background response {queued.id}") == 1, stack.log_tails()  # one driver, start to end
