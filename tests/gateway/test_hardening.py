"""HTTP hardening (issue 28, items 9, 10, 11, 15), against a real gateway and a real Redis: keys on
every endpoint but the probes, a cheap /ready, a client that stops reading cut alone, no web page
driving the API (JSON bodies only, Host checked), and deep JSON refused as a 400."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys

import aiohttp
import pytest

import protocol
from gateway.browser_guard import allowed_hosts, host_name
from tests.support.gateway_harness import (
    MODEL,
    announce,
    publish,
    running_gateway,
    take_request,
    words_script,
    worker_running,
)
from tests.support.worker_harness import wait_for

KEY = "sk-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


# item 9: keys everywhere but the probes; /ready cheap


@pytest.mark.parametrize(
    "method, path", [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/v1/models")]
)
async def test_with_keys_every_endpoint_but_the_probes_needs_one(redis_url, redis_client, method, path) -> None:
    await announce(redis_client)
    async with running_gateway(redis_url, api_keys=KEY) as url, aiohttp.ClientSession() as http:
        async with http.request(method, url + path, json={"prompt": "hi"} if method == "POST" else None) as response:
            assert response.status == 401, await response.text()
            assert (await response.json())["error"]["code"] == "invalid_api_key"


async def test_with_keys_probes_and_the_chat_page_stay_open_and_metrics_scrape_with_a_key(
    redis_url, redis_client
) -> None:
    await announce(redis_client)
    async with running_gateway(redis_url, api_keys=KEY) as url, aiohttp.ClientSession() as http:
        for path in ("/health", "/ready", "/", "/static/app.js"):
            async with http.get(url + path) as response:
                assert response.status == 200, path
        async with http.get(url + "/metrics", headers=AUTH) as response:
            assert response.status == 200
            assert "lmq_http_requests_total" in await response.text()


async def _scans(redis_client) -> int:
    return int((await redis_client.info("commandstats")).get("cmdstat_scan", {}).get("calls", 0))


async def test_ready_does_not_scan_the_keyspace_on_every_call(redis_url, redis_client) -> None:
    await announce(redis_client)
    async with redis_client.pipeline(transaction=False) as pipe:
        for i in range(20_000):
            pipe.set(f"tenant:junk:{i}", b"x")
        await pipe.execute()
    async with running_gateway(redis_url) as url, aiohttp.ClientSession() as http:
        before = await _scans(redis_client)

        async def probe() -> int:
            async with http.get(url + "/ready") as response:
                return response.status

        assert await asyncio.gather(*[probe() for _ in range(40)]) == [200] * 40
        for _ in range(10):
            assert await probe() == 200
        # one heartbeat read is ~20 SCAN calls here; 50 probes read at most once a second
        assert await _scans(redis_client) - before <= 3 * 21


# item 11: a web page cannot drive a local lmq


@pytest.mark.parametrize("path", ["/v1/messages/batches", "/v1/batches", CHAT, "/tokenize"])
async def test_a_text_plain_post_is_refused_with_415(redis_url, redis_client, path) -> None:
    await announce(redis_client)
    body = '{"requests": [{"custom_id": "a", "params": {"model": "tiny-test", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}]}'
    async with running_gateway(redis_url) as url, aiohttp.ClientSession() as http:
        async with http.post(url + path, data=body, headers={"Content-Type": "text/plain"}) as response:
            assert response.status == 415, await response.text()
            payload = await response.json()
        async with http.get(url + "/v1/messages/batches") as response:
            assert (await response.json())["data"] == []  # nothing was created
    assert "error" in payload


async def test_a_foreign_host_header_is_refused_and_local_names_pass(redis_url, redis_client) -> None:
    await announce(redis_client)
    async with running_gateway(redis_url) as url, aiohttp.ClientSession() as http:
        port = url.rsplit(":", 1)[1]
        async with http.get(url + "/v1/files", headers={"Host": f"rebound.evil.example:{port}"}) as response:
            assert response.status == 403
            assert (await response.json())["error"]["code"] == "host_not_allowed"
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
            async with http.get(url + "/v1/models", headers={"Host": host}) as response:
                assert response.status == 200, host
    async with running_gateway(redis_url, allowed_hosts="lmq.internal") as url, aiohttp.ClientSession() as http:
        async with http.get(url + "/v1/models", headers={"Host": "lmq.internal:8000"}) as response:
            assert response.status == 200
        async with http.get(url + "/v1/models", headers={"Host": "localhost"}) as response:
            assert response.status == 403


async def test_a_page_of_another_origin_cannot_post_even_without_a_body(redis_url, redis_client) -> None:
    await announce(redis_client)
    page = "http://localhost:3000"
    async with running_gateway(redis_url) as url, aiohttp.ClientSession() as http:
        cancel = url + "/v1/messages/batches/msgbatch_0123456789abcdef/cancel"
        async with http.post(cancel, headers={"Origin": "https://evil.example"}) as response:
            assert response.status == 403, await response.text()
            assert (await response.json())["error"]["type"] == "permission_error"
        async with http.post(cancel, headers={"Origin": url}) as response:
            assert response.status != 403  # the chat page's own origin
        async with http.post(cancel) as response:
            assert response.status != 403  # no Origin: not a browser
        async with http.post(cancel, headers={"Origin": page}) as response:
            assert response.status == 403
    async with running_gateway(redis_url, allowed_origins=page) as url, aiohttp.ClientSession() as http:
        async with http.post(
            url + "/v1/messages/batches/msgbatch_0123456789abcdef/cancel", headers={"Origin": page}
        ) as response:
            assert response.status != 403


def test_allowed_hosts_defaults_by_listen_address() -> None:
    assert allowed_hosts("", "127.0.0.1") == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts("", "::1") == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts("", "0.0.0.0") is None  # reached by names unknown here: any Host (use keys)
    assert allowed_hosts("*", "127.0.0.1") is None
    assert allowed_hosts("A.example, b.example", "0.0.0.0") == {"a.example", "b.example"}
    assert [host_name(h) for h in ("Localhost:80", "[::1]:8000", "::1", "x")] == ["localhost", "::1", "::1", "x"]


# item 15: deep nesting is a 400 in the API's shape


async def test_deeply_nested_bodies_and_schemas_are_a_400(redis_url, redis_client) -> None:
    await announce(redis_client)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    schema_body = {
        **chat,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema(300)}},
    }
    deep_raw = '{"model": "tiny-test", "x": ' + "[" * 5000 + "]" * 5000 + "}"
    async with running_gateway(redis_url, pickup_timeout=1.0) as url, aiohttp.ClientSession() as http:
        async with http.post(url + CHAT, json=schema_body) as response:
            assert response.status == 400, await response.text()
            assert "deep" in (await response.json())["error"]["message"]
        async with http.post(url + CHAT, data=deep_raw, headers={"Content-Type": "application/json"}) as response:
            assert response.status == 400, await response.text()
            assert (await response.json())["error"]["type"] == "invalid_request_error"
        async with http.post(
            url + "/v1/messages", data=deep_raw, headers={"Content-Type": "application/json"}
        ) as response:
            assert response.status == 400
            assert (await response.json())["type"] == "error"
        async with http.post(
            url + "/v1/messages/batches", data=deep_raw, headers={"Content-Type": "application/json"}
        ) as response:
            assert response.status == 400
            assert (await response.json())["error"]["type"] == "invalid_request_error"


# item 10: a client that stops reading is cut alone


async def _non_reading_stream(port: int) -> socket.socket:
    """A streaming request whose client never reads the answer (a small receive buffer, so the
    gateway, not the kernel, would hold what it is sent)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    body = b'{"model": "tiny-test", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    head = f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    await asyncio.get_running_loop().sock_sendall(sock, head.encode() + body)
    return sock


async def test_a_client_that_stops_reading_is_cut_and_others_stream_on(redis_url, redis_client, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.sse")
    big = ["x" * 65536] * 120  # ~7.5 MiB of deltas for each stream
    async with (
        worker_running(redis_client, words_script(big)),
        worker_running(redis_client, words_script(["Hello", " there"]), model="other", worker_id="other"),
        running_gateway(redis_url, write_timeout=1.0) as url,
        aiohttp.ClientSession() as http,
    ):
        port = int(url.rsplit(":", 1)[1])
        sockets = [await _non_reading_stream(port) for _ in range(8)]
        try:
            body = {"model": "other", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(url + CHAT, json=body) as response:
                text = await asyncio.wait_for(response.text(), 10)
            assert "Hello" in text and "[DONE]" in text

            def cut() -> int:
                return sum("the client read nothing" in record.getMessage() for record in caplog.records)

            for _ in range(300):
                if cut() == 8:
                    break
                await asyncio.sleep(0.1)
            assert cut() == 8
        finally:
            for sock in sockets:
                sock.close()


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.system
async def test_eight_non_reading_streams_leave_the_gateway_process_rss_bounded(
    redis_url, redis_client, tmp_path
) -> None:
    """A gateway process; 8 streams whose clients never read get 12.5 MiB each, paced as a fast model
    would send it; the process's RSS grows by less than a bound (before: by everything sent)."""
    port = _free_port()
    log = open(tmp_path / "gateway.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "lmq", "gateway", "--redis-url", redis_url, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "LMQ_WRITE_TIMEOUT": "1"},
    )
    try:
        await announce(redis_client)
        async with aiohttp.ClientSession() as http:

            async def up() -> bool:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/health") as response:
                        return response.status == 200
                except aiohttp.ClientError:
                    return False

            await wait_for(up, what="the gateway process")
            baseline = _rss_mib(process.pid)
            sockets = [await _non_reading_stream(port) for _ in range(8)]
            taken = [await take_request(redis_client) for _ in sockets]
            peak = baseline
            for i in range(200):
                for _, request in taken:
                    await publish(
                        redis_client, request, [protocol.delta_event(request.id, i, "x" * 65536, [100 + i], i)]
                    )
                peak = max(peak, _rss_mib(process.pid))
                await asyncio.sleep(0.03)
            await asyncio.sleep(1.5)
            peak = max(peak, _rss_mib(process.pid))
            for sock in sockets:
                sock.close()
        assert peak - baseline < 40, f"RSS {baseline:.0f} -> {peak:.0f} MiB"
        assert (tmp_path / "gateway.log").read_text().count("the client read nothing") == 8
    finally:
        process.terminate()
        process.wait(10)
        log.close()
