"""`lmq serve` end to end: embedded Redis, the real default model, the official SDKs, a clean stop."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import anthropic
import openai
import pytest
import redis

from lmq.redis_server import free_tcp_port

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
READY_TIMEOUT_S = 180


def _wait_for_line(log: pathlib.Path, process: subprocess.Popen, marker: str, timeout: float) -> list[str]:
    """The lines logged until one contains `marker`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        lines = log.read_text().splitlines()
        if any(marker in line for line in lines):
            return lines
        time.sleep(0.2)
    raise AssertionError(f"no {marker!r} line within {timeout} s; output:\n{log.read_text()}")


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
        lines = _wait_for_line(log, process, "lmq: ready", READY_TIMEOUT_S)
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


def test_sigterm_stops_everything_redis_included(served) -> None:
    _, redis_url, process = served
    redis_pid = redis.Redis.from_url(redis_url).info("server")["process_id"]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(redis_pid, 0)
