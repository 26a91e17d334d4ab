"""The compose topology as local processes: one Redis, two gateways, three workers on the tiny
model, configured through environment variables as compose configures its containers.

Concurrent streaming requests through both gateways must all complete, and every worker must
have answered some of them (read from each worker's Prometheus /metrics). Workers then stop
cleanly on SIGTERM, as `docker compose stop` asks them to.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from lmq.redis_server import EmbeddedRedis, free_tcp_port
from protocol import worker_key
from tests.support.tiny_model import make_tiny_model

LMQ = Path(sys.executable).with_name("lmq")  # the console script installed next to this Python
MODEL_NAME = "tiny"
GATEWAYS = 2
WORKERS = 3
REQUESTS = 12
MAX_TOKENS = 24
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
LOG_TAIL_LINES = 40


class Processes:
    """Named child processes, each logging to its own file; all stopped by `stop_all`."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.running: dict[str, subprocess.Popen] = {}

    def start(self, name: str, command: str, environment: dict[str, str]) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")
        self.running[name] = subprocess.Popen(
            [str(LMQ), command], env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def assert_alive(self) -> None:
        exited = {name: p.returncode for name, p in self.running.items() if p.poll() is not None}
        assert not exited, f"exited early: {exited}\n{self.log_tails()}"

    def log_tails(self) -> str:
        tails = []
        for name in self.running:
            lines = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
            tails.append(f"--- {name}\n" + "\n".join(lines[-LOG_TAIL_LINES:]))
        return "\n".join(tails)

    def stop_all(self) -> dict[str, int]:
        """SIGTERM to all, as `docker compose stop` sends; SIGKILL to those still running after a while."""
        for process in self.running.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.running.values():
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return {name: process.returncode for name, process in self.running.items()}


@dataclass
class Topology:
    gateway_urls: list[str]
    worker_metrics_urls: dict[str, str]
    processes: Processes


def base_environment(redis_url: str) -> dict[str, str]:
    """This process's environment without any lmq setting, plus the shared Redis."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("LMQ_") and k not in ("REDIS_URL", "PORT")}
    return {**inherited, "REDIS_URL": redis_url}


def wait_until(condition, what: str, processes: Processes) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not condition():
        processes.assert_alive()
        assert time.monotonic() < deadline, f"{what} within {START_TIMEOUT_S} s\n{processes.log_tails()}"
        time.sleep(0.2)


def gateway_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False


def workers_heartbeating(redis_url: str, worker_ids: list[str]) -> bool:
    with redis.Redis.from_url(redis_url) as client:
        return all(client.exists(worker_key(worker_id)) for worker_id in worker_ids)


@pytest.fixture
def topology(tmp_path: Path):
    model_dir = make_tiny_model(tmp_path / "model")
    processes = Processes(tmp_path)
    with EmbeddedRedis(data_dir=tmp_path / "redis", port=free_tcp_port()) as redis_server:
        environment = base_environment(redis_server.url)
        try:
            worker_metrics_urls = start_workers(processes, environment, model_dir)
            gateway_urls = start_gateways(processes, environment)
            wait_until(
                lambda: workers_heartbeating(redis_server.url, list(worker_metrics_urls)),
                "workers heartbeating",
                processes,
            )
            wait_until(lambda: all(gateway_ready(url) for url in gateway_urls), "gateways ready", processes)
            yield Topology(gateway_urls, worker_metrics_urls, processes)
        finally:
            processes.stop_all()


def start_workers(processes: Processes, environment: dict[str, str], model_dir: Path) -> dict[str, str]:
    """Start the workers; returns worker id -> its /metrics URL."""
    metrics_urls = {}
    for index in range(WORKERS):
        worker_id = f"topology-worker-{index}"
        metrics_port = free_tcp_port()
        processes.start(
            worker_id,
            "worker",
            {
                **environment,
                "LMQ_MODEL": str(model_dir),
                "LMQ_MODEL_NAME": MODEL_NAME,
                "LMQ_DTYPE": "float32",
                "LMQ_QUANT": "none",
                "LMQ_DEVICE": "cpu",
                "LMQ_THREADS": "1",
                "LMQ_KV_MEMORY": "8MiB",
                "LMQ_MAX_SEQS": "4",
                "LMQ_GRACE_SECONDS": "2",
                "LMQ_WORKER_ID": worker_id,
                "LMQ_METRICS_PORT": str(metrics_port),
            },
        )
        metrics_urls[worker_id] = f"http://127.0.0.1:{metrics_port}/metrics"
    return metrics_urls


def start_gateways(processes: Processes, environment: dict[str, str]) -> list[str]:
    urls = []
    for index in range(GATEWAYS):
        port = free_tcp_port()
        processes.start(
            f"topology-gateway-{index}", "gateway", {**environment, "LMQ_HOST": "127.0.0.1", "PORT": str(port)}
        )
        urls.append(f"http://127.0.0.1:{port}")
    return urls


@dataclass
class Answer:
    text: str
    finish_reason: str | None
    usage: object


async def stream_chat(client: AsyncOpenAI, prompt: str) -> Answer:
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish_reason, usage = [], None, None
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish_reason = choice.finish_reason or finish_reason
        usage = chunk.usage or usage
    return Answer("".join(text), finish_reason, usage)


def requests_finished(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        families = text_string_to_metric_families(response.read().decode())
    return sum(
        sample.value
        for family in families
        if family.name == "lmq_requests_finished"
        for sample in family.samples
        if sample.name == "lmq_requests_finished_total"
    )


async def test_concurrent_streams_through_two_gateways_spread_over_three_workers(topology: Topology) -> None:
    clients = [
        AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S) for url in topology.gateway_urls
    ]
    prompts = [f"Request {i}: what is the capital of France? The quick brown fox." for i in range(REQUESTS)]
    try:
        answers = await asyncio.wait_for(
            asyncio.gather(*(stream_chat(clients[i % GATEWAYS], prompt) for i, prompt in enumerate(prompts))),
            REQUEST_TIMEOUT_S,
        )
    finally:
        for client in clients:
            await client.close()

    for prompt, answer in zip(prompts, answers):
        assert answer.finish_reason in ("stop", "length"), (prompt, answer)
        assert answer.text, (prompt, answer)
        assert answer.usage is not None and answer.usage.prompt_tokens > 0, (prompt, answer)
        assert 0 < answer.usage.completion_tokens <= MAX_TOKENS, (prompt, answer)
        if answer.finish_reason == "length":
            assert answer.usage.completion_tokens == MAX_TOKENS, (prompt, answer)

    finished = {worker_id: requests_finished(url) for worker_id, url in topology.worker_metrics_urls.items()}
    assert sum(finished.values()) == REQUESTS, finished
    assert all(count > 0 for count in finished.values()), f"a worker took no work: {finished}"
    topology.processes.assert_alive()

    exit_codes = topology.processes.stop_all()
    assert all(exit_codes[worker_id] == 0 for worker_id in topology.worker_metrics_urls), exit_codes
