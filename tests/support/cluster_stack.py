"""Support for tests/system/test_cluster.py: a process `Stack` (tests/support/process_stack.py) of
gateways and workers on an `EmbeddedCluster` (lmq/redis_cluster.py), composed from its topology
(tests/support/redis_topology.py `ClusterTopology`): its processes get the cluster's
`redis+cluster://...?shards=K` URL, its `admin` client is lmq's own cluster client, and what it reads
from the request path it reads from every shard (protocol/keys.py: sharded(K)).
"""

from __future__ import annotations

from pathlib import Path

from lmq.redis_cluster import EmbeddedCluster
from tests.support.process_stack import Stack, StackSpec
from tests.support.redis_topology import ClusterTopology


def cluster_stack(cluster: EmbeddedCluster, spec: StackSpec, root: Path, model_dir: Path) -> Stack:
    return Stack(spec, root, model_dir, ClusterTopology(cluster))
