"""The Redis under a process stack (tests/support/process_stack.py `Stack`): one server, a Sentinel
set, or a cluster, behind one interface, so that a stack is composed from a topology rather than
subclassed per kind.

A topology gives the lmq processes' `url`, the tests' own `admin` client (on a Sentinel set it
follows failovers; on a cluster it is lmq's cluster client), the shard `layout` of its keys, and
what a stack needs to make itself whole before a test: `alive`, `start` (after a test killed it),
`delete_test_keys`, `flush`, `log_tails`, `close`. Only `SingleRedis` owns its server: the
Sentinel set and the cluster belong to their test module's fixture.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import redis
from redis.exceptions import RedisError

from lmq.redis_cluster import EmbeddedCluster
from lmq.redis_server import EmbeddedRedis, find_redis_server, free_tcp_port
from protocol.cluster_url import shard_layout
from protocol.keys import SINGLE, ShardLayout
from protocol.redis_client import connect_sync

ADMIN_TIMEOUTS = dict(socket_timeout=5, socket_connect_timeout=2)
# Keys a test writes itself, deleted before the next one: on one Redis, and on a cluster's shards.
SINGLE_TEST_KEYS = ("lmq:test:*", "lmq:reply:test:*", "lmq:progress:*", "myapp:*", "lmq:dead")
CLUSTER_TEST_KEYS = ("lmq:test:*", "lmq:{*}:test:*", "lmq:{*}:reply:test:*", "myapp:*", "lmq:{*}:dead")


class SingleRedis:
    """One Redis server on a TCP port with its append-only file on, so that it can be SIGKILLed and
    started again on the same port with its data."""

    layout: ShardLayout = SINGLE

    def __init__(self, root: Path, kind: str | None):
        self.server = EmbeddedRedis(
            data_dir=root / "redis", port=free_tcp_port(), server=find_redis_server(kind), appendonly=True
        ).start()
        self.url = self.server.url
        self.admin = redis.Redis.from_url(self.server.url, **ADMIN_TIMEOUTS)

    def alive(self) -> bool:
        return self.server.process is not None and self.server.process.poll() is None

    def start(self) -> None:
        if not self.alive():
            self.server.start()

    def restart(self, *, persist: bool, down_s: float = 0.5) -> None:
        """SIGKILL, wait `down_s`, start again on the same port: with the append-only file (persist), or
        on an empty directory (as a server without persistence comes back)."""
        self.server.kill()
        if not persist:
            for name in ("appendonly.aof", "appendonlydir", "dump.rdb"):
                path = self.server.data_dir / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
        time.sleep(down_s)
        self.server.start()
        self.forget_dead_connections()

    def forget_dead_connections(self) -> None:
        """Close the admin pool's idle connections, dead with the old server, so the next command opens
        a fresh one. Connections in use stay: another thread may be reading from one (the soak's
        sampler), and closing its socket under it raises what no caller expects; its own read
        fails as a ConnectionError if the connection died."""
        self.admin.connection_pool.disconnect(inuse_connections=False)

    def delete_test_keys(self) -> None:
        for pattern in SINGLE_TEST_KEYS:
            for key in self.admin.scan_iter(match=pattern, count=1000):
                self.admin.delete(key)

    def flush(self) -> None:
        self.admin.flushall()

    def log_tails(self) -> str:
        path = self.server.log_path
        return "--- redis\n" + "\n".join(path.read_text(errors="replace").splitlines()[-5:] if path.exists() else [])

    def close(self) -> None:
        self.admin.close()
        self.server.stop()


class SentinelTopology:
    """A tests/support/sentinel_stack.py `SentinelSet`: the processes get its `redis+sentinel://` URL."""

    layout: ShardLayout = SINGLE

    def __init__(self, sentinels):
        self.sentinels = sentinels
        self.server: EmbeddedRedis = sentinels.primary  # the first primary, for its log lines
        self.url = sentinels.url
        self.admin = connect_sync(sentinels.url, **ADMIN_TIMEOUTS)

    def alive(self) -> bool:
        try:
            return bool(self.admin.ping())
        except RedisError:
            return False

    def start(self) -> None:
        """A Sentinel set is its test module's to repair."""

    delete_test_keys = SingleRedis.delete_test_keys
    flush = SingleRedis.flush

    def log_tails(self) -> str:
        return self.sentinels.log_tails()

    def close(self) -> None:
        self.admin.close()


class ClusterTopology:
    """An `EmbeddedCluster` (lmq/redis_cluster.py): the processes get its `redis+cluster://...?shards=K`
    URL, and what a stack reads from the request path it reads from every shard."""

    def __init__(self, cluster: EmbeddedCluster):
        self.cluster = cluster
        self.server: EmbeddedRedis = cluster.nodes[0]
        self.url = cluster.url
        self.layout = shard_layout(cluster.url)
        self.admin = connect_sync(cluster.url, **ADMIN_TIMEOUTS)

    def alive(self) -> bool:
        return all(node.process is not None and node.process.poll() is None for node in self.cluster.nodes)

    def start(self) -> None:
        """A cluster is its test module's to repair."""

    def delete_test_keys(self) -> None:
        for index, node in enumerate(self.cluster.nodes):
            doomed = {key for pattern in CLUSTER_TEST_KEYS for key in self.cluster.keys_on(index, pattern)}
            with node.client() as client, client.pipeline(transaction=False) as pipe:
                for key in doomed:  # one DEL each: a node refuses one over keys of several slots
                    pipe.delete(key)
                pipe.execute()

    def flush(self) -> None:
        self.cluster.flush()

    def log_tails(self) -> str:
        return self.cluster.log_tails()

    def close(self) -> None:
        self.admin.close()
