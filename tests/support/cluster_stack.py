"""Support for tests/system/test_cluster.py: fault_support's `Stack` of gateways and workers on an
`EmbeddedCluster` (lmq/redis_cluster.py) instead of one Redis.

Its processes get the cluster's `redis+cluster://...?shards=K` URL, its `admin` client is
lmq's own cluster client (protocol/redis_client.py: connect_sync), and what the single-Redis
`Stack` reads from the one request stream (pending entries, the group, what is left, dead
letters, heartbeats) it reads from every shard's (protocol/keys.py: sharded(K)).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from redis.exceptions import ResponseError

import protocol
from lmq.redis_cluster import EmbeddedCluster
from protocol import REQUEST_GROUP
from protocol.cluster_url import shard_layout
from protocol.redis_client import connect_sync
from tests.support.process_stack import MODEL, Stack, StackSpec

# Keys a test of test_cluster.py writes itself, deleted before the next one (on each node).
TEST_KEY_PATTERNS = ("lmq:test:*", "lmq:{*}:test:*", "lmq:{*}:reply:test:*", "myapp:*")


class ClusterStack(Stack):
    """Gateways and workers on an EmbeddedCluster (Stack's constructor would start a Redis)."""

    def __init__(self, cluster: EmbeddedCluster, spec: StackSpec, root: Path, model_dir: Path):
        self.cluster = cluster
        self.layout = shard_layout(cluster.url)
        admin = connect_sync(cluster.url, socket_timeout=5, socket_connect_timeout=2)
        self._attach(spec, root, model_dir, cluster.nodes[0], admin, cluster.url)

    @property
    def streams(self) -> list[str]:
        """The interactive request stream of the test model in every shard."""
        return [shard.request_stream(MODEL) for shard in self.layout.shards]

    # ------------------------------------------------------------ what Stack reads from the one stream, from every shard

    def pending(self) -> list[dict]:
        """The pending entries of every shard's stream, each with its `stream`."""
        entries = []
        for stream in self.streams:
            try:
                found = self.admin.xpending_range(stream, REQUEST_GROUP, min="-", max="+", count=1000)
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    continue
                raise
            entries += [{**entry, "stream": stream} for entry in found]
        return entries

    def holder_by_request(self) -> dict[str, str]:
        held = {}
        for entry in self.pending():
            for _, fields in self.admin.xrange(entry["stream"], entry["message_id"], entry["message_id"]):
                with contextlib.suppress(Exception):
                    held[protocol.decode_map(fields[b"msg"])["id"]] = entry["consumer"].decode()
        return held

    def group_exists(self) -> bool:
        try:
            return all(
                any(group["name"] == REQUEST_GROUP.encode() for group in self.admin.xinfo_groups(stream))
                for stream in self.streams
            )
        except ResponseError:
            return False

    def waiting(self) -> int:
        """Entries left in every shard's request stream."""
        return sum(self.admin.xlen(stream) for stream in self.streams)

    def heartbeating(self, names: list[str] | None = None) -> bool:
        names = self.workers if names is None else names
        return all(self.admin.exists(self.layout.home.worker_key(name)) for name in names)

    def dead_letters(self) -> list[dict[bytes, bytes]]:
        return [fields for shard in self.layout.shards for _, fields in self.admin.xrange(shard.dead_letter_stream)]

    def entries_added(self, stream: str) -> int:
        """How many entries a stream ever got (XINFO STREAM, Redis 7): workers delete finished ones."""
        try:
            return int(self.admin.xinfo_stream(stream)["entries-added"])
        except ResponseError:  # no such key
            return 0

    # ------------------------------------------------------------ the cluster in place of one Redis

    def redis_alive(self) -> bool:
        return all(node.process is not None and node.process.poll() is None for node in self.cluster.nodes)

    async def prepare(self) -> None:
        """Before a test: the stack whole (restarted from scratch on an emptied cluster if a test
        left it broken), the test keys and dead letters gone, the workers heartbeating and the
        gateways ready."""
        if self.workers and not self.clean():
            self.reset()
        for index, node in enumerate(self.cluster.nodes):
            doomed = {key for pattern in TEST_KEY_PATTERNS for key in self.cluster.keys_on(index, pattern)}
            doomed |= {key for key in self.cluster.keys_on(index, "lmq:{*}:dead")}
            with node.client() as client, client.pipeline(transaction=False) as pipe:
                for key in doomed:  # one DEL each: a node refuses one over keys of several slots
                    pipe.delete(key)
                pipe.execute()
        while len(self.workers) < self.spec.workers:
            self.start_worker()
        while len(self.gateways) < self.spec.gateways:
            self.start_gateway()
        await self.wait_ready()

    def reset(self) -> None:
        self.processes.kill_all()
        self.workers.clear()
        self.gateways.clear()
        self.cluster.flush()

    def log_tails(self, names: list[str] | None = None, lines: int = 25) -> str:
        return super().log_tails(names, lines) + "\n" + self.cluster.log_tails()

    def close(self) -> None:
        self.processes.kill_all()
        self.admin.close()
