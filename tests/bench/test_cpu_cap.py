"""bench/harness/cpu_cap.py: a capped process gets its share of a core and no more, and comes back uncapped."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.harness import processes
from bench.harness.cpu_cap import CpuCap, CpuCapError

SPIN = "import time\nwhile True: time.perf_counter()"


def test_a_cap_outside_what_the_kernel_allows_is_refused_by_name():
    if not CpuCap.available():
        pytest.skip("no writable cgroup CPU controller here")
    with pytest.raises(CpuCapError, match="between"):
        CpuCap(0.0001)
    with pytest.raises(CpuCapError, match="between"):
        CpuCap(1.5)


@pytest.mark.skipif(not CpuCap.available(), reason="no writable cgroup CPU controller here (needs root)")
def test_a_capped_spinning_process_uses_its_share_of_a_core_and_is_let_go_on_exit():
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        with CpuCap(0.1) as cap:
            cap.add(spinner.pid)
            group = cap.groups[spinner.pid]
            before, started = processes.cpu_seconds(spinner.pid), time.monotonic()
            time.sleep(1.5)
            share = (processes.cpu_seconds(spinner.pid) - before) / (time.monotonic() - started)
            throttled = cap.throttled_s()[spinner.pid]
        assert share < 0.2, f"capped at 0.1 of a core, it used {share:.2f}"
        assert throttled > 0.5, "a spinning process capped at 10% waits for its quota most of the time"
        assert not group.exists(), "the cap's cgroup outlived the cap"
    finally:
        spinner.kill()
        spinner.wait()
