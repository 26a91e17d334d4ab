"""Support for the Sentinel tests (tests/system/test_sentinel.py, test_stream_resume.py,
test_redis_tls.py): a real Sentinel set (one primary, one replica, three sentinels, all local TCP
servers of one binary, the sentinels being `redis-server --sentinel`) with timeouts short enough
that a failover takes seconds, and a process `Stack` (tests/support/process_stack.py) of lmq
processes whose `REDIS_URL` is the set's `redis+sentinel://` URL; `stack_on_sentinels` makes both
and closes both.

With `tls=ServerTls(...)` (lmq/redis_server.py) every server of the set listens over TLS only:
the primary and the replica on their TLS ports, replicating over TLS, and the sentinels on their
own `tls-port`, reaching the servers and each other over TLS; `url` is then `rediss+sentinel://`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from lmq.redis_server import EmbeddedRedis, ServerTls, find_redis_server, free_tcp_port
from tests.support.process_stack import Processes, Stack, StackSpec, eventually
from tests.support.redis_topology import SentinelTopology

SERVICE = "mymaster"
QUORUM = 2
DOWN_AFTER_MS = 1000  # a primary silent this long is down for a sentinel
FAILOVER_TIMEOUT_MS = 3000  # a failover not done by then is retried (by another sentinel)
READY_TIMEOUT_S = 30.0  # sentinels find each other through the primary's hello channel, every 2 s
LISTEN_TIMEOUT_S = 10.0
PORT_TRIES = 5
FAILOVER_WAIT_S = 30.0


class SentinelSet:
    """`start()`, then `url`; `kill_primary()` and `wait_failover()` for the fault; `close()`."""

    def __init__(self, root: Path, kind: str | None = None, *, server: str | None = None, tls: ServerTls | None = None):
        self.root = root
        self.server = server or find_redis_server(kind)
        self.tls = tls
        self.primary = EmbeddedRedis(root / "primary", port=free_tcp_port(), server=self.server, tls=tls)
        self.replica = EmbeddedRedis(root / "replica", port=free_tcp_port(), server=self.server, tls=tls)
        self.sentinel_ports = [free_tcp_port() for _ in range(3)]
        self.processes = Processes(root / "sentinel-logs")

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        if self.tls:
            return f"rediss+sentinel://{hosts}/{SERVICE}/0?{self.tls.url_query()}"
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def client(self, port: int, **options) -> redis.Redis:
        """A plain client of the server or sentinel on `port` (over TLS in a TLS set)."""
        return redis.Redis(port=port, **(self.tls.client_kwargs() if self.tls else {}), **options)

    def start(self) -> SentinelSet:
        self.primary.start()
        self.replica.start()
        with self.client(self.replica.port) as replica:
            replica.replicaof("127.0.0.1", self.primary.port)
            _poll(
                lambda: replica.info("replication").get("master_link_status") == "up",
                "the replica in sync",
                READY_TIMEOUT_S,
            )
        for index in range(len(self.sentinel_ports)):
            self._start_sentinel(index)
        _poll(
            self.ready,
            "three sentinels that see the primary, the replica and each other",
            READY_TIMEOUT_S,
            self.log_tails,
        )
        return self

    def _start_sentinel(self, index: int) -> None:
        """Sentinel `index` on its port, or on a new one where another process took that port first: a free
        port is only free when asked, and the suite's other processes open connections meanwhile (CI saw
        "bind: Address already in use" end a sentinel, and the set never formed)."""
        for _ in range(PORT_TRIES):
            self._launch_sentinel(index, self.sentinel_ports[index])
            if self._listening(index):
                return
            self.sentinel_ports[index] = free_tcp_port()
        raise AssertionError(f"sentinel-{index} found no free port in {PORT_TRIES} tries\n{self.log_tails()}")

    def _listening(self, index: int) -> bool:
        """True once sentinel `index` answers; False if it exited because its port was taken."""
        name, deadline = f"sentinel-{index}", time.monotonic() + LISTEN_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.processes.alive(name):
                if "Address already in use" in self.processes.log_text(name):
                    return False
                raise AssertionError(f"{name} exited at start\n{self.log_tails()}")
            try:
                with self.client(
                    self.sentinel_ports[index], socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
                ) as sentinel:
                    return bool(sentinel.ping())
            except RedisError:
                time.sleep(0.05)
        raise AssertionError(f"{name} did not answer within {LISTEN_TIMEOUT_S:g} s\n{self.log_tails()}")

    def _launch_sentinel(self, index: int, port: int) -> None:
        directory = self.root / f"sentinel-{index}"
        directory.mkdir(parents=True, exist_ok=True)
        config = directory / "sentinel.conf"  # the sentinel rewrites it: its own file, writable
        listen = f"port {port}\n"
        if self.tls:  # the same options as the servers': sentinel.conf lines are the command line's without "--"
            options = self.tls.server_args()
            listen = f"port 0\ntls-port {port}\n" + "".join(
                f"{name[2:]} {value}\n" for name, value in zip(options[::2], options[1::2])
            )
        config.write_text(
            f"{listen}bind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} {QUORUM}\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
        )
        self.processes.start(f"sentinel-{index}", [self.server, str(config), "--sentinel"], dict(os.environ))

    def _ask(self, port: int, *command: str):
        with self.client(port, socket_timeout=2, socket_connect_timeout=2, decode_responses=True) as sentinel:
            return sentinel.execute_command(*command)

    def primary_port(self, sentinel_port: int) -> int | None:
        address = self._ask(sentinel_port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(address[1]) if address else None

    def ready(self) -> bool:
        for port in self.sentinel_ports:
            state = _pairs(self._ask(port, "SENTINEL", "MASTER", SERVICE))
            if int(state["num-slaves"]) < 1 or int(state["num-other-sentinels"]) < 2 or "s_down" in state["flags"]:
                return False
        return True

    def kill_primary(self) -> None:
        """SIGKILL, as a crash of the primary's host."""
        self.primary.kill()

    async def wait_failover(self, timeout: float = FAILOVER_WAIT_S) -> None:
        """Until every sentinel names the replica as the primary and it answers as one."""

        def role(server: EmbeddedRedis) -> str:
            with self.client(server.port, socket_timeout=2) as client:
                return client.info("replication")["role"]

        def promoted() -> bool:
            if any(self.primary_port(port) != self.replica.port for port in self.sentinel_ports):
                return False
            return role(self.replica) == "master"

        await eventually(promoted, "the sentinels to promote the replica", timeout)

    def log_tails(self, lines: int = 8) -> str:
        parts = []
        for name in list(self.processes.running):
            parts.append(f"--- {name}\n" + "\n".join(self.processes.log_text(name).splitlines()[-lines:]))
        for name, server in (("primary", self.primary), ("replica", self.replica)):
            text = server.log_path.read_text(errors="replace").splitlines() if server.log_path.exists() else []
            parts.append(f"--- {name}\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)

    def close(self) -> None:
        """SIGKILL all: a primary stopped by SIGTERM would wait for its replica to catch up."""
        self.processes.kill_all()
        self.replica.kill()
        self.primary.kill()


def sentinel_stack(sentinels: SentinelSet, spec: StackSpec, root: Path, model_dir: Path) -> Stack:
    """A process `Stack` on a Sentinel set: its processes get the set's `redis+sentinel://` URL and its
    `admin` client follows failovers too (tests/support/redis_topology.py `SentinelTopology`)."""
    return Stack(spec, root, model_dir, SentinelTopology(sentinels))


@contextlib.contextmanager
def stack_on_sentinels(root: Path, kind: str | None, spec: StackSpec, model_dir: Path) -> Iterator[Stack]:
    """A started Sentinel set of the server `kind` (find_redis_server's) and a process `Stack` on it,
    both closed after the block; the set is `stack.topology.sentinels`."""
    sentinels = SentinelSet(root / "sentinel-set", kind)
    try:
        sentinels.start()
        with sentinel_stack(sentinels, spec, root / "stack", model_dir) as stack:
            yield stack
    finally:
        sentinels.close()


def _pairs(flat: list) -> dict:
    if isinstance(flat, dict):
        return flat
    return dict(zip(flat[::2], flat[1::2]))


def _poll(check, what: str, timeout: float, details=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except RedisError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{details()}")
        time.sleep(0.1)
