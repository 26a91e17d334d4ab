"""Redis Sentinel: `REDIS_URL=redis+sentinel://...` and a failover that gateways and workers follow.

The URL's parts and the start-up errors of a wrong one, then real Sentinel sets
(tests/support/sentinel_stack.py: a primary, a replica and three sentinels): the client lmq builds
(protocol/redis_client.py) finds the promoted replica after the primary is SIGKILLed; and
through a real gateway and worker, streams in flight when the primary dies end with their exact
text or an error the client sees (never a silent gap, never a hang), as after a Redis restart
(tests/system/test_faults.py), and the next requests succeed on the promoted replica.
"""

from __future__ import annotations

import socket
import time

import pytest

from gateway.config import GatewayConfig
from lmq.checks import check_gateway, check_worker
from lmq.redis_server import free_tcp_port
from lmq.serve import FatalError, check_redis, redacted
from protocol import CANCEL_CHANNEL
from protocol.redis_client import connect
from protocol.sentinel_url import SentinelAddress, is_sentinel_url, parse_sentinel_url
from tests.support.process_stack import (
    CLAIM_IDLE_MS,
    PromptPool,
    StackSpec,
    assert_serves_exactly_again,
    through_a_fault,
)
from tests.support.sentinel_stack import SentinelSet, stack_on_sentinels
from worker.config import WorkerConfig

# ---------------------------------------------------------------- the URL


@pytest.mark.parametrize(
    "url, address",
    [
        ("redis+sentinel://sentinel-a/mymaster", SentinelAddress((("sentinel-a", 26379),), "mymaster")),
        (
            "redis+sentinel://10.0.0.1:26379,10.0.0.2:26380,[::1]:26381,[fe80::1]/cache/3",
            SentinelAddress((("10.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 26381), ("fe80::1", 26379)), "cache", 3),
        ),
        (
            "redis+sentinel://:p%40ss@h1,h2/m/0/",
            SentinelAddress((("h1", 26379), ("h2", 26379)), "m", 0, password="p@ss"),
        ),
        (
            "REDIS+SENTINEL://lmq:secret@h:1/m/2",
            SentinelAddress((("h", 1),), "m", 2, username="lmq", password="secret"),
        ),
        (
            "redis+sentinel://h/m?sentinel_password=s3&sentinel_username=watcher&min_other_sentinels=2",
            SentinelAddress(
                (("h", 26379),), "m", sentinel_username="watcher", sentinel_password="s3", min_other_sentinels=2
            ),
        ),
    ],
)
def test_a_sentinel_url_names_sentinels_service_database_and_logins(url, address):
    assert is_sentinel_url(url)
    assert parse_sentinel_url(url) == address


@pytest.mark.parametrize(
    "url, complaint",
    [
        ("redis+sentinel://h1,h2", "names the service"),
        ("redis+sentinel://h1/", "names the service"),
        ("redis+sentinel:///mymaster", "names its sentinels"),
        ("redis+sentinel://h1,,h2/mymaster", "names its sentinels"),
        ("redis+sentinel://:pw@/mymaster", "names its sentinels"),
        ("redis+sentinel://h1:notaport/mymaster", "port must be a number"),
        ("redis+sentinel://h1:70000/mymaster", "port must be a number"),
        ("redis+sentinel://:26379/mymaster", "has no host"),
        ("redis+sentinel://[::1/mymaster", "IPv6"),
        ("redis+sentinel://h1/mymaster/zero", "database in a Sentinel URL is a number"),
        ("redis+sentinel://h1/mymaster/0/extra", "names the service"),
        ("redis+sentinel://h1/mymaster?password=x", "unknown Sentinel URL option 'password'"),
        ("redis+sentinel://h1/mymaster?min_other_sentinels=two", "min_other_sentinels is a number"),
        ("redis+sentinel://h1/mymaster?sentinel_password=a&sentinel_password=b", "more than once"),
        ("redis+sentinel://h1/mymaster?sentinel_password", "name=value"),
    ],
)
def test_a_wrong_sentinel_url_says_what_is_wrong(url, complaint):
    with pytest.raises(ValueError, match=complaint.replace("(", r"\(")):
        parse_sentinel_url(url)


def test_other_urls_are_not_sentinel_urls():
    assert not any(
        is_sentinel_url(url)
        for url in ("redis://h:6379/0", "rediss://h/0", "unix:///tmp/r.sock?db=0", "sentinel://h/m")
    )


def test_a_wrong_sentinel_url_is_refused_at_start_up_naming_the_setting():
    url = "redis+sentinel://h1:26379,h2:26379"  # no service
    with pytest.raises(ValueError, match=r"^REDIS_URL \(--redis-url\): a Sentinel URL names the service"):
        check_gateway(GatewayConfig(redis_url=url))
    with pytest.raises(ValueError, match=r"^REDIS_URL \(--redis-url\): a Sentinel URL names the service"):
        check_worker(WorkerConfig(redis_url=url))
    check_gateway(GatewayConfig(redis_url="redis+sentinel://h1:26379,h2:26379/mymaster/0"))


def test_no_password_of_a_sentinel_url_shows_in_messages():
    shown = redacted("redis+sentinel://lmq:primary-pw@h1,h2/m/0?sentinel_password=sentinel-pw&min_other_sentinels=1")
    assert "primary-pw" not in shown and "sentinel-pw" not in shown
    assert shown.startswith("redis+sentinel://lmq:***@h1,h2/m/0?") and "min_other_sentinels=1" in shown


def test_sentinels_that_do_not_answer_fail_the_start_up_check_in_one_line():
    ports = [free_tcp_port(), free_tcp_port()]
    url = f"redis+sentinel://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/mymaster/0"
    started = time.monotonic()
    with pytest.raises(FatalError) as failure:
        check_redis(url, (CANCEL_CHANNEL,), timeout=2)
    # A contract, not a speed: the check answers within its timeout's order (redis-py's retries took 13.7 s).
    assert time.monotonic() - started < 3 * 2
    message = str(failure.value)
    assert message.startswith(f"cannot reach Redis at {url}: no sentinel names a primary for 'mymaster'"), message
    assert all(f"127.0.0.1:{port}" in message for port in ports) and "\n" not in message and len(message) < 600, message


# ---------------------------------------------------------------- a real Sentinel set


@pytest.fixture
def sentinel_set(tmp_path, request):
    """A started SentinelSet of the server kind given as the fixture's parameter (default: find_redis_server's)."""
    sentinels = SentinelSet(tmp_path / "sentinel-set", getattr(request, "param", None))
    try:
        yield sentinels.start()
    finally:
        sentinels.close()


def test_a_sentinel_whose_port_was_taken_meanwhile_starts_on_another(tmp_path):
    """A free port is only free when asked: another process may bind it before the sentinel starts."""
    sentinels = SentinelSet(tmp_path / "sentinel-set")
    taken = sentinels.sentinel_ports[1]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))  # as a client's connection holds its local port
        try:
            sentinels.start()
            assert sentinels.sentinel_ports[1] != taken and sentinels.ready()
            assert "Address already in use" in sentinels.processes.log_text("sentinel-1")
        finally:
            sentinels.close()


@pytest.mark.parametrize("sentinel_set", ["valkey9", "redis6"], indirect=True)
async def test_the_client_follows_a_failover_to_the_promoted_replica(sentinel_set):
    check_redis(sentinel_set.url, (CANCEL_CHANNEL,))  # the start-up check reads the URL too
    client = connect(sentinel_set.url)
    try:
        await client.set("lmq:test:before", b"1")
        assert (await client.info("server"))["tcp_port"] == sentinel_set.primary.port
        sentinel_set.kill_primary()
        await sentinel_set.wait_failover()
        assert await client.set("lmq:test:after", b"2")  # its pooled connection died: it asks the sentinels again
        assert (await client.info("server"))["tcp_port"] == sentinel_set.replica.port
        assert await client.get("lmq:test:before") == b"1"  # replicated before the crash
    finally:
        await client.aclose()
    check_redis(sentinel_set.url, (CANCEL_CHANNEL,))


# ---------------------------------------------------------------- a failover under a gateway and a worker


@pytest.fixture(scope="module")
async def pool(tiny) -> PromptPool:
    return await PromptPool.build(tiny, size=8, candidates=20)


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_primary_killed_mid_stream_clients_see_exact_text_or_an_error_then_the_promoted_replica_serves(
    tmp_path, tiny_model_dir, pool
):
    with stack_on_sentinels(tmp_path, None, StackSpec("sentinel", workers=1, gateways=1), tiny_model_dir) as stack:
        sentinels = stack.topology.sentinels
        await stack.prepare()
        expected = pool.take(4)

        async def primary_dies(_) -> None:
            sentinels.kill_primary()

        streams = await through_a_fault(stack, expected, primary_dies, chunks=3)
        outcomes = [
            stream.assert_exact_or_visible_error(expected[stream.prompt].text, stack.log_tails()) for stream in streams
        ]
        print(
            f"in-flight streams across the failover: {outcomes}; {[stream.error for stream in streams if stream.error]}"
        )

        await sentinels.wait_failover()
        await assert_serves_exactly_again(stack, pool, "after the failover")
        assert stack.admin.info("server")["tcp_port"] == sentinels.replica.port
        assert stack.group_exists()
        await stack.wait_drained(5 * CLAIM_IDLE_MS / 1000 + 10)
        stack.assert_alive()
