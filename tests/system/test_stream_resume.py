"""Streams resume across a Redis restart or failover (protocol/resume.py): real processes.

A Redis SIGKILLed and restarted with its append-only file, or a Sentinel primary SIGKILLed and its
replica promoted, breaks every gateway's reply subscription, and pub/sub keeps nothing of what the
workers published meanwhile. The workers still hold every token: the gateway asks for what it
missed, the worker holding each request re-establishes it on the server it now talks to and sends
it again. The client sees nothing of the fault: every stream ends with exactly the text of an
undisturbed run (float32 greedy). Only when no worker answers within `LMQ_RESUME_TIMEOUT` does the
client get the visible `unavailable` error. Each case runs on Redis 6.2 and Valkey 9.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.process_stack import (
    CLIENT_TIMEOUT_S,
    PromptPool,
    Stack,
    StackSpec,
    eventually,
    inexact,
    through_a_fault,
)
from tests.support.sentinel_stack import SERVICE, SentinelSet, stack_on_sentinels

KINDS = ["redis6", "valkey9"]
RESUME_TIMEOUT_S = 15  # the gateway's default
CLAIM_WAIT_S = 15.0

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
async def pool(tiny) -> PromptPool:
    return await PromptPool.build(tiny)


async def _through_a_fault(stack: Stack, pool: PromptPool, streams: int, fault) -> list[str]:
    """`streams` streams, `fault()` once all show text; the problems seen: any stream that did not
    end with exactly the undisturbed text."""
    expected = pool.take(streams)
    return inexact(await through_a_fault(stack, expected, lambda _: fault()), expected)


@pytest.fixture(params=KINDS)
def restart_stack(request, tmp_path, tiny_model_dir):
    with Stack(StackSpec(request.param, workers=2, gateways=1), tmp_path / "stack", tiny_model_dir) as stack:
        yield stack


async def test_redis_killed_and_restarted_every_stream_ends_with_its_exact_text(restart_stack, pool):
    stack = restart_stack
    await stack.prepare()

    async def restart():
        await asyncio.to_thread(stack.restart_redis, persist=True, down_s=1.0)

    problems = await _through_a_fault(stack, pool, streams=4, fault=restart)
    assert not problems, "\n".join(problems) + f"\n{stack.log_tails()}"
    stack.assert_alive()
    await stack.wait_drained(CLAIM_WAIT_S)


@pytest.fixture(params=KINDS)
def sentinel_stack(request, tmp_path, tiny_model_dir):
    with stack_on_sentinels(
        tmp_path, request.param, StackSpec("sentinel", workers=1, gateways=1), tiny_model_dir
    ) as stack:
        yield stack


async def test_sentinel_failover_every_stream_ends_with_its_exact_text(sentinel_stack, pool):
    stack, sentinels = sentinel_stack, sentinel_stack.topology.sentinels
    await stack.prepare()

    async def failover():
        sentinels.kill_primary()
        await sentinels.wait_failover()

    problems = await _through_a_fault(stack, pool, streams=4, fault=failover)
    assert not problems, "\n".join(problems) + f"\n{stack.log_tails()}"
    assert stack.admin.info("server")["tcp_port"] == sentinels.replica.port
    stack.assert_alive()
    await stack.wait_drained(CLAIM_WAIT_S)


@pytest.mark.parametrize("kind", KINDS)
async def test_no_worker_answers_the_resume_the_client_gets_the_visible_error(kind, tmp_path, tiny_model_dir, pool):
    """The only worker dies with Redis: nobody holds the streams' tokens. Within the resume bound
    (3 s here) plus a little, each stream ends with the `unavailable` error, after a prefix of its text."""
    with Stack(StackSpec(kind, workers=1, gateways=1), tmp_path / "stack", tiny_model_dir) as stack:
        stack.start_worker()
        stack.start_gateway(LMQ_RESUME_TIMEOUT="3")
        await stack.wait_ready()
        expected, started = pool.take(4), 0.0

        async def worker_and_redis_die(_) -> None:
            nonlocal started
            stack.kill_worker(stack.workers[0])
            started = time.monotonic()
            await asyncio.to_thread(stack.restart_redis, persist=True, down_s=0.5)

        runs = await through_a_fault(stack, expected, worker_and_redis_die)
        ended = time.monotonic() - started
        for run in runs:
            assert run.assert_exact_or_visible_error(expected[run.prompt].text, stack.log_tails()) == "error", (
                run.describe()
            )
            assert "answer may be lost" in run.error, run.describe()
        assert ended < CLIENT_TIMEOUT_S, ended


@pytest.mark.long
@pytest.mark.parametrize("kind", KINDS)
async def test_ten_redis_restarts_in_a_row_under_16_streams(kind, tmp_path, tiny_model_dir, pool):
    """The black-box target of issue 30: 10 faults in a row, each a Redis SIGKILL + restart while 16
    greedy streams run; every stream exact."""
    with Stack(StackSpec(kind, workers=2, gateways=1), tmp_path / "stack", tiny_model_dir) as stack:
        for _ in range(2):
            stack.start_worker(LMQ_MAX_SEQS="8", LMQ_KV_MEMORY="16MiB")
        stack.start_gateway()
        await stack.wait_ready()

        async def restart():
            await asyncio.to_thread(stack.restart_redis, persist=True, down_s=0.2)

        problems, started = [], time.monotonic()
        for number in range(10):
            problems += [
                f"fault {number + 1}: {problem}" for problem in await _through_a_fault(stack, pool, 16, restart)
            ]
        print(
            f"16 streams through each of 10 Redis restarts on {kind}: {time.monotonic() - started:.1f} s, {len(problems)} inexact"
        )
        assert not problems, "\n".join(problems) + f"\n{stack.log_tails()}"
        stack.assert_alive()


async def _fail_over_and_rejoin(sentinels: SentinelSet) -> None:
    """SIGKILL the primary, wait for the replica's promotion, then start the old primary again as the
    new primary's replica, in sync and seen by every sentinel: ready to be promoted at the next fault."""
    sentinels.kill_primary()
    await sentinels.wait_failover()
    old = sentinels.primary
    sentinels.primary, sentinels.replica = sentinels.replica, old
    old.start()
    with sentinels.client(old.port) as client:  # what the sentinels would do within ~10 s, done at once
        client.replicaof("127.0.0.1", sentinels.primary.port)

    seen: list = []

    def rejoined() -> bool:
        with sentinels.client(old.port, socket_timeout=2) as client:
            link = client.info("replication")
        views = [
            [_pairs(replica) for replica in sentinels._ask(port, "SENTINEL", "REPLICAS", SERVICE)]
            for port in sentinels.sentinel_ports
        ]
        seen[:] = [
            link.get("role"),
            link.get("master_link_status"),
            [[(r["port"], r["flags"]) for r in v] for v in views],
        ]
        if link.get("role") != "slave" or link.get("master_link_status") != "up":
            return False
        return all(any(int(r["port"]) == old.port and _healthy(r["flags"]) for r in view) for view in views)

    try:
        await eventually(rejoined, "the old primary back as a replica the sentinels see", 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nlast seen (role, link, each sentinel's replicas): {seen}") from None


def _healthy(flags: str) -> bool:
    return not {"s_down", "o_down", "disconnected"} & set(flags.split(","))


def _pairs(flat) -> dict:
    return flat if isinstance(flat, dict) else dict(zip(flat[::2], flat[1::2]))


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", KINDS)
async def test_ten_sentinel_failovers_in_a_row_under_16_streams(kind, tmp_path, tiny_model_dir, pool):
    """10 failovers in a row (the primary SIGKILLed, the replica promoted, the old primary back as a
    replica), each while 16 greedy streams run; every stream exact."""
    with stack_on_sentinels(tmp_path, kind, StackSpec("sentinel", workers=2, gateways=1), tiny_model_dir) as stack:
        sentinels = stack.topology.sentinels
        for _ in range(2):
            stack.start_worker(LMQ_MAX_SEQS="8", LMQ_KV_MEMORY="16MiB")
        stack.start_gateway()
        await stack.wait_ready()
        problems, started = [], time.monotonic()
        for number in range(10):
            missed = await _through_a_fault(stack, pool, 16, lambda: _fail_over_and_rejoin(sentinels))
            problems += [f"failover {number + 1}: {problem}" for problem in missed]
        print(
            f"16 streams through each of 10 failovers on {kind}: {time.monotonic() - started:.1f} s, {len(problems)} inexact"
        )
        assert not problems, "\n".join(problems) + f"\n{stack.log_tails()}"
        stack.assert_alive()
