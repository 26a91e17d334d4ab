"""`lmq serve` end to end: embedded Redis, the real default model, the official SDKs, a clean stop;
two servers in one directory, each with its own Redis."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.request

import anthropic
import openai
import pytest
import redis

from lmq.redis_server import free_tcp_port
from tests.support.process_logs import wait_for_line

slow = pytest.mark.slow  # the tests on the real default model

MODEL = "SmolLM2-135M-Instruct"
READY_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`lmq serve` in its own folder; yields (base URL, the embedded Redis URL, the process)."""
    port = free_tcp_port()
    folder = tmp_path_factory.mktemp("serve")
    log = folder / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMQ_") and k not in ("REDIS_URL", "PORT")}
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "lmq", "serve", "--port", str(port)],
            cwd=folder,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        lines = wait_for_line(log, process, "lmq: ready", READY_TIMEOUT_S)
        redis_url = next(line.split(" at ", 1)[1].strip() for line in lines if "embedded Redis" in line)
        yield f"http://127.0.0.1:{port}", redis_url, process
    finally:
        if process.poll() is None:  # a failed test: stop it as an operator would, so Redis goes too
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@slow
def test_openai_sdk_streams_a_sensible_answer(served) -> None:
    base_url, _, _ = served
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage.prompt_tokens == 37  # the reference's rendered prompt for this question
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


@slow
def test_anthropic_sdk_gets_a_message(served) -> None:
    base_url, _, _ = served
    client = anthropic.Anthropic(base_url=base_url, api_key="unused")
    message = client.messages.create(
        model=MODEL,
        max_tokens=32,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body={"temperature": 0},
    )
    assert "Paris" in message.content[0].text
    assert message.stop_reason == "end_turn"


@slow
def test_sigterm_stops_everything_redis_included(served) -> None:
    _, redis_url, process = served
    redis_pid = redis.Redis.from_url(redis_url).info("server")["process_id"]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(redis_pid, 0)


def _start(folder: pathlib.Path, port: int, env: dict[str, str], log: pathlib.Path) -> subprocess.Popen:
    with log.open("w") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "lmq", "serve", "--port", str(port)],
            cwd=folder,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )


def _stop(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def test_two_servers_in_one_directory_each_have_their_own_redis(tmp_path, tiny_model_dir) -> None:
    """Neither takes the other's Redis over, and stopping one leaves the other serving."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMQ_") and k not in ("REDIS_URL", "PORT")}
    env.update(
        LMQ_MODEL=str(tiny_model_dir),
        LMQ_MODEL_NAME="tiny",
        LMQ_DTYPE="float32",
        LMQ_QUANT="none",
        LMQ_KV_MEMORY="4MiB",
    )
    ports = [free_tcp_port(), free_tcp_port()]
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = _start(tmp_path, ports[0], env, logs[0])
    second = None
    try:
        lines = [wait_for_line(logs[0], first, "lmq: ready", READY_TIMEOUT_S)]
        second = _start(tmp_path, ports[1], env, logs[1])
        lines.append(wait_for_line(logs[1], second, "lmq: ready", READY_TIMEOUT_S))
        urls = [next(line.split(" at ", 1)[1].strip() for line in found if "embedded Redis" in line) for found in lines]
        assert urls[0] != urls[1]
        pids = [redis.Redis.from_url(url).info("server")["process_id"] for url in urls]
        assert pids[0] != pids[1]
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=10) as response:
                assert response.status == 200
        assert _stop(second) == 0
        body = json.dumps({"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{ports[0]}/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 3
        assert _stop(first) == 0
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert not (tmp_path / ".lmq").exists(), "nothing left in the working directory"
    assert all(not pathlib.Path(url.removeprefix("unix://").split("?")[0]).parent.exists() for url in urls), (
        "nor in /tmp"
    )
