"""examples/producer.py, the documented foreign producer, against `lmq worker` run as a command."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest
import redis
from tiny_model import make_tiny_model

import protocol

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def lmq_worker(tmp_path, redis_url):
    model_dir = make_tiny_model(tmp_path / "tiny")
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "lmq", "worker", "--model", str(model_dir), "--model-name", "tiny", "--kv-memory", "4MiB", "--worker-id", "cli"]
    process = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 60
    while not client.exists(protocol.worker_key("cli")):
        assert process.poll() is None and time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    yield redis_url
    process.terminate()
    assert process.wait(30) == 0
    assert not client.exists(protocol.worker_key("cli"))
    client.close()


@pytest.mark.parametrize("reply", ["stream", "pubsub"])
def test_the_example_producer_gets_its_answer_without_a_gateway(lmq_worker, reply):
    command = [sys.executable, str(REPO / "examples" / "producer.py"), "--reply", reply, "--max-tokens", "5", "Hello there"]
    result = subprocess.run(command, env={**os.environ, "REDIS_URL": lmq_worker}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "[length; usage {'prompt_tokens':" in result.stderr
    assert "'completion_tokens': 5" in result.stderr
