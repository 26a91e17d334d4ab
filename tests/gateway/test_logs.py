"""Logs people can use: one access line per request, one request id from the client's
X-Request-Id (or a generated one) through the gateway's and the worker's lines and back in the
response header, `--log-format json` / `--log-level` (flags before or after the subcommand, or
LMQ_* variables), and no progress-bar `\\r` lines outside a terminal."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

import protocol
from lmq import logs
from lmq.redis_server import free_tcp_port
from tests.support.gateway_harness import MODEL, announce, running_gateway, words_script, worker_running
from worker.model.loader import load_model

CHAT = "/v1/chat/completions"
ACCESS_FIELDS = {
    "request_id",
    "method",
    "path",
    "api",
    "model",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "ttft_ms",
    "duration_ms",
}


def chat_body(model: str = MODEL, **fields):
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.fixture
def access(caplog):
    caplog.set_level(logging.DEBUG, logger="gateway.access")
    return lambda: [r for r in caplog.records if r.name == "gateway.access"]


@pytest.fixture
async def gateway(redis_url, redis_client):
    async with running_gateway(redis_url, pickup_timeout=5.0) as url, aiohttp.ClientSession() as http:
        async with worker_running(redis_client, words_script(["Hello", " there"], prompt_tokens=7)) as received:
            yield url, http, received


# ---------------------------------------------------------------- the gateway: ids and access lines


async def test_the_clients_request_id_goes_everywhere(gateway, access) -> None:
    url, http, received = gateway
    async with http.post(url + CHAT, json=chat_body(), headers={"X-Request-Id": "client-42.a:b"}) as response:
        assert response.status == 200
        body = await response.json()
        assert response.headers["X-Request-Id"] == "client-42.a:b"
    assert body["id"] == "client-42.a:b"
    assert [r.id for r in received] == ["client-42.a:b"], "the worker gets it as the request's id"
    (line,) = [r for r in access() if r.path == CHAT]
    assert line.levelno == logging.INFO
    assert {name: getattr(line, name) for name in ACCESS_FIELDS} | {"ttft_ms": 0, "duration_ms": 0} == {
        "request_id": "client-42.a:b", "method": "POST", "path": CHAT, "api": "openai", "model": MODEL,
        "status": 200, "prompt_tokens": 7, "completion_tokens": 2, "ttft_ms": 0, "duration_ms": 0,
    }  # fmt: skip
    assert 0 <= line.ttft_ms <= line.duration_ms
    assert line.getMessage().startswith(
        "request_id=client-42.a:b method=POST path=/v1/chat/completions api=openai model=tiny-test status=200"
    )


@pytest.mark.parametrize("sent", [None, "has space", "semi;colon", "x" * 129, ""])
async def test_without_a_usable_id_one_is_generated(gateway, access, sent) -> None:
    url, http, received = gateway
    headers = {} if sent is None else {"X-Request-Id": sent}
    async with http.post(url + CHAT, json=chat_body(stream=True), headers=headers) as response:
        generated = response.headers["X-Request-Id"]
        await response.read()
    assert generated.startswith("chatcmpl-") and generated != sent
    assert [r.id for r in received] == [generated]
    (line,) = [r for r in access() if r.path == CHAT]
    assert (line.request_id, line.status, line.completion_tokens) == (generated, 200, 2)


async def test_anthropic_requests_and_errors_are_logged_too(gateway, access) -> None:
    url, http, _ = gateway
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(url + "/v1/messages", json=body, headers={"X-Request-Id": "anth-1"}) as response:
        assert (response.status, response.headers["X-Request-Id"], (await response.json())["id"]) == (
            200,
            "anth-1",
            "anth-1",
        )
    async with http.post(
        url + CHAT, json=chat_body(model="no-such-model"), headers={"X-Request-Id": "nf-1"}
    ) as response:
        assert (response.status, response.headers["X-Request-Id"]) == (404, "nf-1")
    async with http.get(url + "/nowhere") as response:
        assert response.status == 404 and response.headers["X-Request-Id"].startswith("req-")
    lines = {r.path: r for r in access()}
    assert (lines["/v1/messages"].api, lines["/v1/messages"].status, lines["/v1/messages"].completion_tokens) == (
        "anthropic",
        200,
        2,
    )
    assert (lines[CHAT].request_id, lines[CHAT].status) == ("nf-1", 404)
    assert (lines["/nowhere"].status, lines["/nowhere"].api) == (404, None)


async def test_probes_log_at_debug(gateway, access) -> None:
    url, http, _ = gateway
    async with http.get(url + "/health") as response:
        assert response.status == 200
    (line,) = [r for r in access() if r.path == "/health"]
    assert line.levelno == logging.DEBUG


async def test_an_id_in_progress_is_refused(redis_url, redis_client, access) -> None:
    """Two requests with one id at once would share a reply queue: the second gets 409."""
    await announce(redis_client)  # a worker that never answers: the first request stays in flight
    async with running_gateway(redis_url, pickup_timeout=30.0) as url, aiohttp.ClientSession() as http:

        async def send_first() -> None:
            async with http.post(url + CHAT, json=chat_body(), headers={"X-Request-Id": "twice"}) as response:
                await response.read()

        first = asyncio.create_task(send_first())
        while not await redis_client.xlen(protocol.request_stream(MODEL)):
            await asyncio.sleep(0.02)
        async with http.post(url + CHAT, json=chat_body(), headers={"X-Request-Id": "twice"}) as response:
            assert response.status == 409, await response.text()
            assert response.headers["X-Request-Id"] == "twice"
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    for _ in range(100):  # the first one's line comes once the server saw the client leave
        if len([r for r in access() if r.path == CHAT]) == 2:
            break
        await asyncio.sleep(0.02)
    assert sorted(r.status for r in access() if r.path == CHAT) == [409, 499]


# ---------------------------------------------------------------- lmq/logs.py


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logs._handler, logs._format = None, "text"


def test_json_lines_carry_the_extra_fields(restore_logging) -> None:
    stream = io.StringIO()
    logs.setup("DEBUG", "json", stream=stream)
    logging.getLogger("t").info("request_id=%s started", "r1", extra={"request_id": "r1"})
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("t").exception("failed")
    logs.fatal("it broke\non two lines", stream=stream)
    first, second, third = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert first["message"] == "request_id=r1 started" and first["request_id"] == "r1"
    assert (first["level"], first["logger"]) == ("INFO", "t") and first["time"].endswith("Z")
    assert "ValueError: boom" in second["exception"]
    assert (third["level"], third["message"]) == ("ERROR", "it broke on two lines")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_bars_only_on_a_terminal(tiny_model_dir, monkeypatch, terminal) -> None:
    stderr = FakeTerminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    load_model(str(tiny_model_dir), dtype="float32", quant="none", device="cpu")
    assert ("loading tiny" in stderr.getvalue()) is terminal
    assert ("\r" in stderr.getvalue()) is terminal


def test_the_global_flags_work_before_the_subcommand(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMQ_")}
    result = subprocess.run(
        [sys.executable, "-m", "lmq", "--log-format", "json", "worker", "--model", str(tmp_path / "missing")],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    line = json.loads(result.stderr.strip().splitlines()[-1])
    assert line["level"] == "ERROR" and "LMQ_MODEL" in line["message"]


# ---------------------------------------------------------------- the real processes


@pytest.mark.system
def test_serve_logs_json_with_one_id_from_gateway_to_worker(tiny_model_dir, tmp_path) -> None:
    """`lmq serve --log-format json` (after the subcommand), the level from LMQ_LOG_LEVEL."""
    port = free_tcp_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMQ_") and k not in ("REDIS_URL", "PORT")}
    env.update(
        LMQ_MODEL=str(tiny_model_dir),
        LMQ_MODEL_NAME="tiny",
        LMQ_DTYPE="float32",
        LMQ_QUANT="none",
        LMQ_KV_MEMORY="4MiB",
        LMQ_LOG_LEVEL="DEBUG",
    )
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "lmq", "serve", "--port", str(port), "--log-format", "json"],
            cwd=tmp_path,
            env=env,
            stdout=stdout,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 120
        while "lmq: ready" not in out.read_text():
            assert process.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
        request = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        headers = {"X-Request-Id": "trace-me-1", "Content-Type": "application/json"}
        body = json.dumps(request).encode()
        import urllib.request

        with urllib.request.urlopen(
            urllib.request.Request(f"http://127.0.0.1:{port}{CHAT}", body, headers), timeout=60
        ) as response:
            assert response.headers["X-Request-Id"] == "trace-me-1"
            assert json.loads(response.read())["id"] == "trace-me-1"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = err.read_text()
    assert "\r" not in text, "no progress bar in a log file"
    records = [json.loads(line) for line in text.splitlines()]  # every line is one JSON object
    mine = [r for r in records if r.get("request_id") == "trace-me-1"]
    (line,) = [r for r in mine if r["logger"] == "gateway.access"]
    assert (line["status"], line["api"], line["model"], line["completion_tokens"]) == (200, "openai", "tiny", 3)
    assert line["prompt_tokens"] > 0 and line["ttft_ms"] is not None and line["duration_ms"] >= line["ttft_ms"]
    worker_lines = [r["message"] for r in mine if r["logger"] == "worker.service"]
    assert [m.split(":")[0] for m in worker_lines] == [
        "request_id=trace-me-1 started",
        "request_id=trace-me-1 finished",
    ]
    assert any(r["level"] == "DEBUG" for r in records), "LMQ_LOG_LEVEL=DEBUG applies"
    assert not (pathlib.Path(tmp_path) / ".lmq").exists()
