"""Start, await and stop the server processes a benchmark needs; read their CPU time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def python_command(*args: str) -> list[str]:
    return [sys.executable, *args]


def start(command: list[str], log_path: Path, cwd: Path = ROOT) -> subprocess.Popen:
    """Run `command` (from the repository root by default), output to `log_path`, in its own process group."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_http_ok(url: str, watched: list[subprocess.Popen], timeout_s: float) -> None:
    """Poll `url` until it answers 200; fail early if a watched process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in watched:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args[:4]} exited with {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f} s")


def stop(process: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it lingers."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
