"""lmq/redis_cluster.py: an embedded cluster starts though a port it picked was taken before its node bound it."""

from __future__ import annotations

import socket

from lmq.redis_cluster import EmbeddedCluster


def test_a_node_whose_bus_port_another_process_took_starts_on_other_ports(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cluster = EmbeddedCluster(primaries=1, root=tmp_path / "cluster")
        cluster.nodes[0].bus_port = taken.getsockname()[1]  # as if another process bound it meanwhile
        with cluster:
            node = cluster.nodes[0]
            assert node.bus_port != taken.getsockname()[1]
            with node.client() as client:
                assert client.execute_command("CLUSTER", "INFO").decode().startswith("cluster_state:ok")
