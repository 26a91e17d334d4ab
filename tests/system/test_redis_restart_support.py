"""The test stack's Redis restart (tests/support/redis_topology.py) while another thread is mid-command.

The soak samples Redis from a thread while its faults restart the server. After a restart the admin
client's pool drops the connections that died with the old server; it must leave alone one that
another thread is reading from (the soak's sampler was, and got "I/O operation on closed file"
from under redis-py, an error no caller expects).
"""

from __future__ import annotations

import threading
import time

from tests.support.redis_topology import SingleRedis


def test_forgetting_dead_connections_leaves_a_command_in_flight_alone(tmp_path):
    topology = SingleRedis(tmp_path, "valkey9")
    try:
        outcome: list[object] = []

        def blocked_read() -> None:
            try:
                outcome.append(topology.admin.blpop(["lmq:test:never"], timeout=1))
            except Exception as exc:  # noqa: BLE001 - the test reports whatever escapes
                outcome.append(exc)

        reader = threading.Thread(target=blocked_read)
        reader.start()
        time.sleep(0.3)  # the BLPOP is on the wire, its connection in use
        topology.forget_dead_connections()
        reader.join(5)
        assert outcome == [None], f"the in-flight BLPOP ended with {outcome!r}"
        assert topology.admin.ping()
    finally:
        topology.close()
