"""The queue without a model: an embedded Redis (or Redis Cluster), N `lmq gateway` processes and M
stub worker processes.

Shared by bench/service/queue_overhead.py (one of each) and bench/service/redis_saturation.py (N and M of choice,
one Redis or a cluster of P primaries). The workers run bench/harness/stub_worker.py, whose model answers
at once, so every CPU second measured is the plumbing's: HTTP and SSE in the gateways, scheduling,
sampling, detokenization and the step script in the workers, streams, scripts and pub/sub in Redis.

A cluster is only a different `REDIS_URL` to the gateways and workers. What reads Redis here must
see every server, so it goes through `redis_nodes` (the one Redis, or each primary) and the key
layout of that URL (`layout`: heartbeats live under the home shard's prefix).
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.harness import processes
from lmq.redis_cluster import EmbeddedCluster
from lmq.redis_server import EmbeddedRedis, free_tcp_port
from protocol.cluster_url import shard_layout
from protocol.keys import ShardLayout
from protocol.redis_client import connect_sync

STUB_MAX_SEQS = 256


class StubServices:
    """Start with `with StubServices(...) as services:`; `urls` are the gateways' …/v1 base URLs.

    `cluster` > 0 runs an EmbeddedCluster of that many primaries with `shards` request shards
    (default two per primary) in place of the one embedded Redis."""

    def __init__(
        self,
        kv_memory: str,
        logs: Path,
        gateways: int = 1,
        workers: int = 1,
        log_prefix: str = "overhead",
        max_seqs: int = STUB_MAX_SEQS,
        cluster: int = 0,
        shards: int | None = None,
    ):
        if gateways < 1 or workers < 1:
            raise ValueError("at least one gateway and one worker")
        self.redis = EmbeddedCluster(cluster, shards or 2 * cluster) if cluster else EmbeddedRedis()
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

    @property
    def redis_url(self) -> str:
        return self.redis.url

    @property
    def redis_nodes(self) -> list[EmbeddedRedis]:
        """Every Redis server process: the one Redis, or each primary of the cluster."""
        return self.redis.nodes if isinstance(self.redis, EmbeddedCluster) else [self.redis]

    @property
    def redis_server(self) -> str:
        """What answers, e.g. "valkey 9.1.2" (a cluster's nodes all run one binary)."""
        node = self.redis_nodes[0]
        return f"{node.name} {node.version}"

    @property
    def layout(self) -> ShardLayout:
        return shard_layout(self.redis_url)

    def __enter__(self) -> StubServices:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        self.redis.start()
        redis_url = self.redis_url
        for i, port in enumerate(self.ports):
            self.gateways.append(processes.start(
                processes.python_command("-m", "lmq", "gateway", "--port", str(port), "--redis-url", redis_url, "--max-queue", "4096"),
                self.logs / f"{self.log_prefix}-gateway-{i}.log",
            ))  # fmt: skip
        for i in range(self.worker_count):
            self.workers.append(processes.start(
                processes.python_command("bench/harness/stub_worker.py", "--redis-url", redis_url, "--max-seqs", str(self.max_seqs),
                                         "--kv-memory", self.kv_memory, "--threads", "1"),
                self.logs / f"{self.log_prefix}-worker-{i}.log",
            ))  # fmt: skip
        watched = [*self.gateways, *self.workers]
        for port in self.ports:
            processes.wait_http_ok(f"http://127.0.0.1:{port}/ready", watched, timeout_s=300)
        self._wait_for_workers(watched, timeout_s=300)

    def _wait_for_workers(self, watched: list, timeout_s: float) -> None:
        """Until every worker has a heartbeat (a gateway is ready as soon as the first one has)."""
        client = connect_sync(self.redis_url)
        pattern = f"{self.layout.home.worker_key_prefix}*"
        deadline = time.monotonic() + timeout_s
        try:
            while len(list(client.scan_iter(match=pattern))) < self.worker_count:
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
        """CPU seconds so far: Redis (all its nodes), all gateways together, all workers together,
        and this (client) process."""
        return {
            "gateway": sum(processes.cpu_seconds(p.pid) for p in self.gateways),
            "worker": sum(processes.cpu_seconds(p.pid) for p in self.workers),
            "redis": sum(self.redis_node_cpu()),
            "client": time.process_time(),
        }

    def redis_node_cpu(self) -> list[float]:
        """CPU seconds so far of each Redis server process, in the order of `redis_nodes`."""
        return [processes.cpu_seconds(node.process.pid) for node in self.redis_nodes]
