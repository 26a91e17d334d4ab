"""TLS to a Sentinel set and to a Redis Cluster: `rediss+sentinel://` and `rediss+cluster://`.

First the URLs (protocol/tls_url.py): what they take, and what they refuse by name. Then real
servers built with TLS (tests/support/tls_redis.py: Debian's Redis, certificates made here with
openssl; the tests skip and say why where there is none): a Sentinel set whose primary, replica
and sentinels all listen over TLS only and ask for a client certificate, and a three-primary
cluster over TLS (its bus too). A gateway and a worker complete requests over each, with the
exact text an undisturbed engine gives; a client that trusts another CA, or shows no client
certificate, is refused at lmq's start-up check with a message that says so.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from gateway.config import GatewayConfig
from lmq.checks import check_gateway
from lmq.redis_cluster import EmbeddedCluster
from lmq.redis_server import EmbeddedRedis
from lmq.serve import FatalError, check_redis, redacted
from protocol import CANCEL_CHANNEL
from protocol.cluster_url import ClusterAddress, is_cluster_url, parse_cluster_url
from protocol.redis_client import connect, connect_sync, pubsub
from protocol.sentinel_url import SentinelAddress, is_sentinel_url, parse_sentinel_url
from protocol.tls_url import TlsOptions
from tests.support.cluster_stack import cluster_stack
from tests.support.process_stack import CLIENT_TIMEOUT_S, MAX_TOKENS, MODEL, StackSpec, chat_messages, expected_answers
from tests.support.sentinel_stack import SentinelSet, sentinel_stack
from tests.support.tls_redis import make_certificates, openssl_missing, other_ca, tls_server

pytestmark = pytest.mark.timeout(180)

FILES = "ssl_ca_certs=/certs/ca.pem&ssl_certfile=/certs/client.pem&ssl_keyfile=/certs/client.key"
CLIENT_CERT = TlsOptions("/certs/ca.pem", "/certs/client.pem", "/certs/client.key")

# ---------------------------------------------------------------- the URLs


@pytest.mark.parametrize(
    "url, address",
    [
        (
            "rediss+sentinel://h1,h2:26380/m/1",
            SentinelAddress((("h1", 26379), ("h2", 26380)), "m", 1, tls=TlsOptions()),
        ),
        (
            f"REDISS+SENTINEL://:pw@h/m?{FILES}&sentinel_password=s",
            SentinelAddress((("h", 26379),), "m", password="pw", sentinel_password="s", tls=CLIENT_CERT),
        ),
        (
            "rediss+sentinel://h/m?ssl_ca_certs=/ca.pem&ssl_check_hostname=no",
            SentinelAddress((("h", 26379),), "m", tls=TlsOptions("/ca.pem", check_hostname=False)),
        ),
        ("redis+sentinel://h/m", SentinelAddress((("h", 26379),), "m", tls=None)),
    ],
)
def test_a_tls_sentinel_url_carries_its_ca_and_client_certificate(url, address):
    assert is_sentinel_url(url) and not is_cluster_url(url)
    assert parse_sentinel_url(url) == address


@pytest.mark.parametrize(
    "url, address",
    [
        ("rediss+cluster://h1:7000,h2:7001", ClusterAddress((("h1", 7000), ("h2", 7001)), tls=TlsOptions())),
        (
            f"rediss+cluster://:pw@h:7000/?shards=6&{FILES}",
            ClusterAddress((("h", 7000),), 6, password="pw", tls=CLIENT_CERT),
        ),
        (
            "rediss+cluster://h:7000?ssl_check_hostname=false",
            ClusterAddress((("h", 7000),), tls=TlsOptions(check_hostname=False)),
        ),
        ("redis+cluster://h:7000?shards=4", ClusterAddress((("h", 7000),), 4, tls=None)),
    ],
)
def test_a_tls_cluster_url_carries_its_ca_and_client_certificate(url, address):
    assert is_cluster_url(url) and not is_sentinel_url(url)
    assert parse_cluster_url(url) == address


@pytest.mark.parametrize(
    "url, complaint",
    [
        (
            "redis+sentinel://h/m?ssl_ca_certs=/ca.pem",
            r"ssl_ca_certs is a TLS option: a URL over TLS starts with rediss\+sentinel://",
        ),
        (
            "redis+cluster://h:1?ssl_certfile=/c.pem&ssl_keyfile=/c.key",
            r"ssl_certfile is a TLS option: a URL over TLS starts with rediss\+cluster://",
        ),
        ("rediss+sentinel://h/m?ssl_certfile=/c.pem", "ssl_certfile and ssl_keyfile come together"),
        ("rediss+cluster://h:1?ssl_keyfile=/c.key", "ssl_certfile and ssl_keyfile come together"),
        ("rediss+sentinel://h/m?ssl_ca_certs=", "ssl_ca_certs is the path of a PEM file"),
        ("rediss+cluster://h:1?ssl_check_hostname=maybe", "ssl_check_hostname is yes or no, not 'maybe'"),
        ("rediss+sentinel://h/m?ssl_cert_reqs=none", "unknown Sentinel URL option 'ssl_cert_reqs'"),
        ("rediss+cluster://h:1?ssl_cert_reqs=none", "unknown Redis Cluster URL option 'ssl_cert_reqs'"),
        ("rediss+cluster://h:1?ssl_ca_certs=/a&ssl_ca_certs=/b", "'ssl_ca_certs' is given more than once"),
        ("rediss+sentinel://h/m?ssl_ca_certs=/a&ssl_ca_certs=/b", "'ssl_ca_certs' is given more than once"),
    ],
)
def test_a_wrong_tls_option_is_refused_by_name(url, complaint):
    parse = parse_sentinel_url if is_sentinel_url(url) else parse_cluster_url
    with pytest.raises(ValueError, match=complaint):
        parse(url)


def test_a_wrong_tls_url_is_refused_at_start_up_naming_the_setting():
    with pytest.raises(ValueError, match=r"^REDIS_URL \(--redis-url\): ssl_keyfile is a TLS option"):
        check_gateway(GatewayConfig(redis_url="redis+cluster://h:7000?ssl_keyfile=/k"))
    check_gateway(GatewayConfig(redis_url=f"rediss+sentinel://h1,h2/m/0?{FILES}"))


# ---------------------------------------------------------------- real TLS servers


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory):
    server, reason = tls_server()
    if server is None or openssl_missing():
        pytest.skip(reason or openssl_missing())
    return server, make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_sentinels(tls_files, tmp_path_factory: pytest.TempPathFactory):
    server, tls = tls_files
    started = SentinelSet(tmp_path_factory.mktemp("tls-sentinels"), server=server, tls=tls)
    try:
        yield started.start()
    finally:
        started.close()


@pytest.fixture(scope="module")
def tls_cluster(tls_files, tmp_path_factory: pytest.TempPathFactory):
    server, tls = tls_files
    with EmbeddedCluster(
        primaries=3, shards=6, root=tmp_path_factory.mktemp("tls-cluster"), server=server, tls=tls
    ) as started:
        yield started


def test_the_servers_listen_over_tls_only(tls_files, tls_sentinels, tls_cluster):
    """The set-up the other tests rely on: no plain-TCP answer from any of the servers."""
    plain = [
        f"redis://127.0.0.1:{tls_sentinels.primary.port}/0",
        f"redis://127.0.0.1:{tls_sentinels.sentinel_ports[0]}/0",
        f"redis://127.0.0.1:{tls_cluster.ports[0]}/0",
    ]
    for url in plain:
        with pytest.raises(FatalError, match="cannot reach Redis"):
            check_redis(url, timeout=2)
    assert tls_sentinels.url.startswith("rediss+sentinel://") and tls_cluster.url.startswith("rediss+cluster://")


async def test_the_protocol_clients_work_over_a_tls_sentinel_set_and_a_tls_cluster(tls_sentinels, tls_cluster):
    """lmq's clients (protocol/redis_client.py), blocking and asyncio, commands and pub/sub."""
    for url in (tls_sentinels.url, tls_cluster.url):
        check_redis(url, (CANCEL_CHANNEL,), timeout=5)
        blocking = connect_sync(url, socket_timeout=5)
        client = connect(url)
        try:
            blocking.set("lmq:test:tls", "blocking")
            assert await client.get("lmq:test:tls") == b"blocking"
            subscription = await pubsub(client)
            await subscription.subscribe("lmq:test:tls-channel")
            assert (await subscription.get_message(timeout=5))["type"] == "subscribe"
            await client.publish("lmq:test:tls-channel", "over tls")
            message = await subscription.get_message(ignore_subscribe_messages=True, timeout=5)
            assert message is not None and message["data"] == b"over tls", url
            await subscription.aclose()
            await client.delete("lmq:test:tls")
        finally:
            await client.aclose()
            blocking.close()


@pytest.mark.parametrize("kind", ["sentinel", "cluster"])
def test_a_client_that_trusts_another_ca_is_refused_saying_so(kind, tls_files, tls_sentinels, tls_cluster, tmp_path):
    _, tls = tls_files
    url = (tls_sentinels if kind == "sentinel" else tls_cluster).url.replace(str(tls.ca), str(other_ca(tmp_path)))
    with pytest.raises(FatalError) as refused:
        check_redis(url, (CANCEL_CHANNEL,), timeout=3)
    message = str(refused.value)
    assert "CERTIFICATE_VERIFY_FAILED" in message and "ssl_ca_certs must name the CA that signed it" in message, message
    assert "\n" not in message


def test_a_client_without_a_certificate_is_refused_saying_so(tls_files, tls_sentinels, tmp_path):
    _, tls = tls_files
    url = tls_sentinels.url.split("?")[0] + f"?ssl_ca_certs={tls.ca}"
    with pytest.raises(FatalError) as refused:
        check_redis(url, timeout=3)
    message = str(
        refused.value
    )  # TLS 1.3 sends the alert after the handshake: the client may see it, or only the socket closed
    assert f"sentinel 127.0.0.1:{tls_sentinels.sentinel_ports[0]}: " in message, message
    assert "CERTIFICATE_REQUIRED" in message or "EOF occurred in violation of protocol" in message, message


def test_rediss_to_one_tls_server_passes_the_start_up_check(tls_files, tmp_path):
    """rediss:// to one server, the form that already was: the embedded TLS server's own URL."""
    server, tls = tls_files
    from lmq.redis_server import free_tcp_port

    with EmbeddedRedis(tmp_path / "one", port=free_tcp_port(), server=server, tls=tls) as one:
        assert one.url.startswith("rediss://")
        check_redis(one.url, (CANCEL_CHANNEL,), timeout=5)


# ---------------------------------------------------------------- a gateway and a worker over TLS

PROMPTS = [f"TLS {i}: the quick brown fox jumps over the lazy dog." for i in range(3)]


async def _complete_requests(stack, tiny) -> None:
    """Non-streamed and streamed chat completions through the stack's gateway: each the exact text
    of an undisturbed run of the engine."""
    expected = await expected_answers(tiny, PROMPTS)
    await stack.prepare()
    client = openai.AsyncOpenAI(
        base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )
    options = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})

    async def answer(index: int, prompt: str) -> str:
        if index % 2:
            return (
                (await client.chat.completions.create(messages=chat_messages(prompt), **options))
                .choices[0]
                .message.content
            )
        stream = await client.chat.completions.create(messages=chat_messages(prompt), stream=True, **options)
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])

    try:
        texts = await asyncio.gather(*(answer(index, prompt) for index, prompt in enumerate(PROMPTS)))
    finally:
        await client.close()
    problems = [
        f"{prompt!r}: {text!r}, expected {expected[prompt].text!r}"
        for prompt, text in zip(PROMPTS, texts)
        if text != expected[prompt].text
    ]
    assert not problems, "\n".join(problems) + f"\n{stack.log_tails()}"


async def test_a_gateway_and_a_worker_complete_requests_over_a_tls_sentinel_set(
    tls_sentinels, tmp_path: Path, tiny_model_dir, tiny
):
    spec = StackSpec("tls-sentinel", workers=1, gateways=1)
    with sentinel_stack(tls_sentinels, spec, tmp_path, tiny_model_dir) as stack:
        await _complete_requests(stack, tiny)


async def test_a_gateway_and_a_worker_complete_requests_over_a_tls_cluster(
    tls_cluster, tmp_path: Path, tiny_model_dir, tiny
):
    with cluster_stack(tls_cluster, StackSpec("tls-cluster", workers=1, gateways=1), tmp_path, tiny_model_dir) as stack:
        await _complete_requests(stack, tiny)


def test_no_password_of_a_tls_url_shows_in_messages():
    assert redacted("rediss+sentinel://lmq:pw1@h1,h2/m/0?sentinel_password=pw2&ssl_ca_certs=/c/ca.pem") == (
        "rediss+sentinel://lmq:***@h1,h2/m/0?sentinel_password=***&ssl_ca_certs=/c/ca.pem"
    )
    assert (
        redacted("rediss+cluster://:pw1@h:7000/?shards=6&ssl_ca_certs=/c/ca.pem")
        == "rediss+cluster://:***@h:7000/?shards=6&ssl_ca_certs=/c/ca.pem"
    )


def test_without_a_tls_server_the_tests_skip_saying_why(monkeypatch, tmp_path):
    import tests.support.tls_redis as tls_support

    monkeypatch.setattr(tls_support, "TLS_SERVER_LINK", tmp_path / "none")
    monkeypatch.delenv("LMQ_TLS_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    server, reason = tls_support.tls_server()
    assert (
        server is None and reason.startswith("no Redis server built with TLS (tried ") and "valkey-server" in reason
    ), reason
