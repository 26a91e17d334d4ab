"""examples/producer.py, the documented foreign producer, against `lmq worker` run as a command."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest
import redis

import protocol
from tests.support.tiny_model import make_tiny_model

REPO = pathlib.Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0  # a new Python process imports torch and loads the model: a minute on 2 busy cores
RUN_TIMEOUT_S = 120.0


@pytest.fixture
def lmq_worker(tmp_path, redis_url):
    model_dir = make_tiny_model(tmp_path / "tiny")
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "lmq",
        "worker",
        "--model",
        str(model_dir),
        "--model-name",
        "tiny",
        "--kv-memory",
        "4MiB",
        "--worker-id",
        "cli",
    ]
    log = tmp_path / "worker.log"
    with log.open("wb") as output:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while not client.exists(protocol.worker_key("cli")):
            assert process.poll() is None, (
                f"the worker exited with {process.returncode}:\n{log.read_text(errors='replace')[-4000:]}"
            )
            assert time.monotonic() < deadline, (
                f"the worker did not start within {START_TIMEOUT_S} s:\n{log.read_text(errors='replace')[-4000:]}"
            )
            time.sleep(0.05)
    except BaseException:
        process.kill()
        process.wait()
        raise
    yield redis_url
    process.terminate()
    assert process.wait(RUN_TIMEOUT_S) == 0
    assert not client.exists(protocol.worker_key("cli"))
    client.close()


@pytest.mark.parametrize("reply", ["stream", "pubsub"])
def test_the_example_producer_gets_its_answer_without_a_gateway(lmq_worker, reply):
    command = [
        sys.executable,
        str(REPO / "examples" / "producer.py"),
        "--reply",
        reply,
        "--max-tokens",
        "5",
        "Hello there",
    ]
    result = subprocess.run(
        command, env={**os.environ, "REDIS_URL": lmq_worker}, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    assert "[length; usage {'prompt_tokens':" in result.stderr
    assert "'completion_tokens': 5" in result.stderr
