"""Cap processes' CPU with a Linux cgroup's CFS quota, so that a small machine can show where a server saturates.

On a machine of two cores the clients, gateways and workers fill the cores long before a Redis does, so
what several Redis nodes carry against one can only be derived from CPU per token at light load, where a
node pays a wake-up for nearly every call. Capping each Redis at the same small share of a core makes the
Redis the limit for real: at saturation it handles several calls per wake-up, as a busy one does, and
tokens/s then measure it. Each capped process gets a cgroup of its own (`cpu.max` on cgroup v2, or
`cpu.cfs_quota_us` on v1's cpu controller), and the whole process (every thread) is moved into it.

Needs root (or a delegated cgroup); `CpuCap.available()` says whether this machine allows it.
"""

from __future__ import annotations

import os
from pathlib import Path

V2_ROOT = Path("/sys/fs/cgroup")
V1_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000  # the quota's period: 100 ms, the kernel's default, longer for caps under 1%
MIN_QUOTA_US = 1_000  # the kernel's smallest quota
MAX_PERIOD_US = 1_000_000  # and its longest period: no cap below 0.1% of a core


class CpuCapError(RuntimeError):
    pass


def cgroup_root() -> tuple[Path, int] | None:
    """(the root to make groups under, the cgroup version), or None where no CPU controller is writable."""
    if (V2_ROOT / "cgroup.subtree_control").exists():  # v2: children get cpu.max only where it is delegated
        found = (V2_ROOT, 2) if "cpu" in (V2_ROOT / "cgroup.subtree_control").read_text().split() else None
    else:
        found = (V1_ROOT, 1) if (V1_ROOT / "cpu.cfs_quota_us").exists() else None
    return found if found and _can_make_groups(found[0]) else None


def _can_make_groups(root: Path) -> bool:
    probe = root / f"lmq-cpu-cap-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:  # not root, a read-only cgroup mount, a container without delegation
        return False


class CpuCap:
    """`with CpuCap(fraction) as cap: cap.add(pid)` keeps each added process to `fraction` of one core
    (its own group, so capped processes do not share a quota); on exit each goes back to the root group
    and the groups are removed."""

    def __init__(self, fraction: float):
        found = cgroup_root()
        if found is None:
            raise CpuCapError("no writable cgroup CPU controller here (capping needs root or a delegated cgroup)")
        if not MIN_QUOTA_US / MAX_PERIOD_US <= fraction <= 1:
            raise CpuCapError(f"a CPU cap is between {MIN_QUOTA_US / MAX_PERIOD_US} and 1 of a core, not {fraction}")
        self.root, self.version = found
        self.period_us = max(PERIOD_US, round(MIN_QUOTA_US / fraction))
        self.quota_us = round(fraction * self.period_us)
        self.groups: dict[int, Path] = {}

    @staticmethod
    def available() -> bool:
        return cgroup_root() is not None

    def add(self, pid: int) -> None:
        group = self.root / f"lmq-cpu-cap-{os.getpid()}-{pid}"
        group.mkdir(exist_ok=True)
        if self.version == 2:
            (group / "cpu.max").write_text(f"{self.quota_us} {self.period_us}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(self.period_us))
            (group / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        (group / "cgroup.procs").write_text(str(pid))
        self.groups[pid] = group

    def throttled_s(self) -> dict[int, float]:
        """Seconds each capped process has waited for its quota so far (the proof that it was the limit)."""
        return {pid: _throttled_us(group, self.version) / 1e6 for pid, group in self.groups.items()}

    def __enter__(self) -> CpuCap:
        return self

    def __exit__(self, *exc: object) -> None:
        for pid, group in self.groups.items():
            try:
                (self.root / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # the process is gone; its group empties with it
            try:
                group.rmdir()
            except OSError:
                pass
        self.groups.clear()


def _throttled_us(group: Path, version: int) -> float:
    for line in (group / "cpu.stat").read_text().splitlines():
        name, value = line.split()
        if version == 2 and name == "throttled_usec":
            return float(value)
        if version == 1 and name == "throttled_time":  # nanoseconds
            return float(value) / 1000
    return 0.0
