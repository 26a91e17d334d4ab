"""The queue without a model: an embedded Redis, N `lmq gateway` processes and M stub worker processes.

Shared by bench/queue_overhead.py (one of each) and bench/redis_saturation.py (N and M of choice).
The workers run bench/stub_worker.py, whose model answers at once, so every CPU second measured is
the plumbing's: HTTP and SSE in the gateways, scheduling, sampling, detokenization and the step
script in the workers, streams, scripts and pub/sub in Redis.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench import processes
from lmq.redis_server import EmbeddedRedis, free_tcp_port
from protocol.keys import WORKER_KEY_PREFIX

STUB_MAX_SEQS = 256


class StubServices:
    """Start with `with StubServices(...) as services:`; `urls` are the gateways' …/v1 base URLs."""

    def __init__(
        self,
        kv_memory: str,
        logs: Path,
        gateways: int = 1,
        workers: int = 1,
        log_prefix: str = "overhead",
        max_seqs: int = STUB_MAX_SEQS,
    ):
        if gateways < 1 or workers < 1:
            raise ValueError("at least one gateway and one worker")
        self.redis = EmbeddedRedis()
        self.kv_memory = kv_memory
        self.logs = logs
        self.log_prefix = log_prefix
        self.max_seqs = max_seqs
        self.ports = [free_tcp_port() for _ in range(gateways)]
        self.worker_count = workers
        self.gateways: list = []
        self.workers: list = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}/v1" for port in self.ports]

    @property
    def url(self) -> str:
        return self.urls[0]

    def __enter__(self) -> "StubServices":
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        self.redis.start()
        redis_url = self.redis.url
        for i, port in enumerate(self.ports):
            self.gateways.append(processes.start(
                processes.python_command("-m", "lmq", "gateway", "--port", str(port), "--redis-url", redis_url, "--max-queue", "4096"),
                self.logs / f"{self.log_prefix}-gateway-{i}.log",
            ))  # fmt: skip
        for i in range(self.worker_count):
            self.workers.append(processes.start(
                processes.python_command("bench/stub_worker.py", "--redis-url", redis_url, "--max-seqs", str(self.max_seqs),
                                         "--kv-memory", self.kv_memory, "--threads", "1"),
                self.logs / f"{self.log_prefix}-worker-{i}.log",
            ))  # fmt: skip
        watched = [*self.gateways, *self.workers]
        for port in self.ports:
            processes.wait_http_ok(f"http://127.0.0.1:{port}/ready", watched, timeout_s=300)
        self._wait_for_workers(watched, timeout_s=300)

    def _wait_for_workers(self, watched: list, timeout_s: float) -> None:
        """Until every worker has a heartbeat (a gateway is ready as soon as the first one has)."""
        import redis

        client = redis.Redis.from_url(self.redis.url)
        deadline = time.monotonic() + timeout_s
        try:
            while len(list(client.scan_iter(match=f"{WORKER_KEY_PREFIX}*"))) < self.worker_count:
                for process in watched:
                    if process.poll() is not None:
                        raise RuntimeError(f"{process.args[:4]} exited with {process.returncode} at start")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not all {self.worker_count} workers started within {timeout_s:.0f} s")
                time.sleep(0.25)
        finally:
            client.close()

    def __exit__(self, *exc: object) -> None:
        for process in [*self.gateways, *self.workers]:
            processes.stop(process)
        self.redis.stop()

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: Redis, all gateways together, all workers together, and this (client) process."""
        return {
            "gateway": sum(processes.cpu_seconds(p.pid) for p in self.gateways),
            "worker": sum(processes.cpu_seconds(p.pid) for p in self.workers),
            "redis": processes.cpu_seconds(self.redis.process.pid),
            "client": time.process_time(),
        }
