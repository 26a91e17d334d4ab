"""The soak's processes: the test suite's stack (an `lmq gateway`, two worker processes on the tiny
float32 model with slowed steps) on one Redis with its append-only file or on a Sentinel set, and what
the soak asks of it.

The tiny model (random weights, made on the spot) has a 4,096-token context here, room for tool
definitions; its workers take 8 sequences in 32 MiB of KV cache.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import redis
import redis.asyncio as aioredis

import protocol
from protocol import DEAD_LETTER_STREAM, REQUEST_GROUP
from protocol.redis_client import connect
from tests.support.process_stack import CLAIM_IDLE_MS, MODEL, Stack, StackSpec, eventually
from tests.support.redis_topology import SentinelTopology
from tests.support.sentinel_stack import SentinelSet
from tests.support.tiny_model import make_tiny_model

WORKERS = 2
WORKER_SETTINGS = {"LMQ_MAX_SEQS": "8", "LMQ_KV_MEMORY": "32MiB"}
REDIS_KIND = "valkey9"


class SoakStack:
    """`topology` "redis": one Redis with its append-only file; "sentinel": a Sentinel set (a primary,
    a replica, three sentinels; tests/support/sentinel_stack.py), whose primary a fault kills."""

    def __init__(self, root: Path, topology: str = "redis"):
        model_dir = make_tiny_model(root / "model")
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
        self.sentinels = SentinelSet(root / "sentinels", REDIS_KIND).start() if topology == "sentinel" else None
        under = SentinelTopology(self.sentinels) if self.sentinels else None
        self.stack = Stack(StackSpec(REDIS_KIND, workers=WORKERS, gateways=1), root, model_dir, under)
        self.admin: redis.Redis = self.stack.admin
        self.model = MODEL
        self.request_stream = protocol.request_stream(MODEL)
        self.claim_idle_s = CLAIM_IDLE_MS / 1000
        for _ in range(WORKERS):
            self.start_worker()
        self._gateway = self.stack.start_gateway()
        self._port = int(self.stack.gateway_urls[self._gateway].rsplit(":", 1)[1])

    def __enter__(self) -> SoakStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()
        if self.sentinels:
            self.sentinels.close()

    # ------------------------------------------------------------ what traffic and faults use

    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def async_admin(self) -> aioredis.Redis:
        """lmq's own client of the topology (on a Sentinel set it follows the primary)."""
        return connect(self.stack.url)

    @property
    def workers(self) -> list[str]:
        return self.stack.workers

    def start_worker(self) -> str:
        return self.stack.start_worker(**WORKER_SETTINGS)

    def kill_worker(self, name: str) -> None:
        self.stack.kill_worker(name)

    def signal(self, name: str, sig: int) -> None:
        self.stack.signal(name, sig)

    def restart_gateway(self) -> str:
        """SIGKILL the gateway and start a new one on the same port (clients keep their URL)."""
        self.stack.processes.signal(self._gateway, signal.SIGKILL)
        self.stack.processes.kill(self._gateway)
        self.stack.gateways.remove(self._gateway)
        self._gateway = self.stack.start_gateway(port=self._port)
        return self._gateway

    def restart_redis(self) -> None:
        self.stack.restart_redis(persist=True)

    async def fail_over(self) -> str:
        """SIGKILL the Sentinel set's primary, wait for the replica's promotion, then start the old
        primary again: the sentinels make it the new primary's replica, ready for the next failover."""
        if self.sentinels is None:
            raise RuntimeError("a Sentinel failover needs --topology sentinel")
        sentinels, old = self.sentinels, self.sentinels.primary
        sentinels.kill_primary()
        await sentinels.wait_failover()
        await asyncio.to_thread(old.start)
        sentinels.primary, sentinels.replica = sentinels.replica, old
        await eventually(lambda: _replicating(sentinels, old), "the old primary back as a replica", 60)
        return f"primary :{old.port} SIGKILLed, :{sentinels.primary.port} promoted, :{old.port} back as its replica"

    async def wait_ready(self) -> None:
        await self.stack.wait_ready()

    def add_entries(self, entries: tuple[dict, ...]) -> None:
        for fields in entries:
            self.admin.xadd(self.request_stream, fields)

    # ------------------------------------------------------------ what the sampler reads

    def pids(self) -> dict[str, int]:
        running = {
            name: process.pid for name, process in self.stack.processes.running.items() if process.poll() is None
        }
        servers = {"redis": self.stack.redis}
        if self.sentinels:
            servers = {"redis-primary": self.sentinels.primary, "redis-replica": self.sentinels.replica}
        for name, server in servers.items():
            if server.process is not None and server.process.poll() is None:
                running[name] = server.process.pid
        return running

    def queue(self) -> dict[str, int]:
        streams = [self.request_stream, protocol.request_stream(MODEL, "batch")]
        entries = sum(self.admin.xlen(stream) for stream in streams)
        pending = 0
        for stream in streams:
            try:
                pending += self.admin.xpending(stream, REQUEST_GROUP)["pending"]
            except redis.ResponseError:
                pass  # no group yet
        return {"entries": entries, "pending": pending}

    def dead_letter_count(self) -> int:
        return self.admin.xlen(DEAD_LETTER_STREAM)


def _replicating(sentinels: SentinelSet, server) -> bool:
    with sentinels.client(server.port, socket_timeout=2) as client:
        info = client.info("replication")
    return info["role"] == "slave" and info.get("master_link_status") == "up"
