"""Waiting on what a child process writes to its log file."""

from __future__ import annotations

import pathlib
import subprocess
import time


def wait_for_line(log: pathlib.Path, process: subprocess.Popen, marker: str, timeout: float = 180) -> list[str]:
    """The lines logged until one contains `marker`; fails if the process exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        lines = log.read_text().splitlines()
        if any(marker in line for line in lines):
            return lines
        time.sleep(0.2)
    raise AssertionError(f"no {marker!r} line within {timeout} s; output:\n{log.read_text()}")
