"""The Redis client lmq's processes use: a bounded pool that waits for a free connection, and
reconnects a command whose pooled connection died.

redis-py's default pool raises "Too many connections" once 100 commands are in flight, which a
gateway with a few hundred open requests reaches; waiting a moment for a connection is right.
After a Redis restart every pooled connection is dead: without a retry, each one would fail the
one request that next picks it up.

A `redis+sentinel://` URL (protocol/sentinel_url.py) gives the same pool, but each new
connection asks the sentinels where the primary is now. A failover is then a restart at a new
address, and what survives a restart survives it: the broken connections fail or are retried
as after a restart, the pub/sub subscriptions of the gateway and the worker reconnect (to the
new primary) and fail what they may have missed, the worker recreates a consumer group the
promoted replica lacks.

A `redis+cluster://` URL (protocol/cluster_url.py) gives redis-py's cluster client, which routes
each command to the primary of its key's slot and follows the slot map as it changes. Its pools
do not wait for a free connection (they raise past their size), so they are made larger.

`rediss+sentinel://` and `rediss+cluster://` (protocol/tls_url.py) are the same over TLS: every
connection, to a sentinel, the primary it names or a cluster node, is TLS with the URL's CA and
client certificate.
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel
import redis.cluster
import redis.retry
import redis.sentinel
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ClusterDownError, ConnectionError, RedisClusterException, RedisError, TimeoutError

from .cluster_url import is_cluster_url, parse_cluster_url
from .sentinel_url import SentinelAddress, is_sentinel_url, parse_sentinel_url
from .tls_url import TlsOptions

# What a command may raise when Redis fails: redis-py's errors, and, from a cluster client that
# reaches no node, RedisClusterException (which is not a RedisError). A cluster with a primary
# down refuses every command (CLUSTERDOWN) until it is back: unreachable too, not a refusal.
REDIS_FAILURES = (RedisError, RedisClusterException)
UNREACHABLE = (ConnectionError, TimeoutError, RedisClusterException, ClusterDownError)

MAX_CONNECTIONS = 100
MAX_CLUSTER_CONNECTIONS = 1000  # per node
CONNECTION_WAIT_S = 10.0
RETRIES = 3  # per command: backoff 0.05, 0.1, 0.2 s, enough to get past a dead pooled connection
# A sentinel, or a primary that a failover left behind, may be a host that is gone: a connection
# attempt gives up after this long and the next sentinel (or the new primary) is asked instead.
SENTINEL_SOCKET_TIMEOUT_S = 2.0
CLUSTER_SOCKET_TIMEOUT_S = 5.0  # redis-py's default, named: a blocking read on a cluster must end before it
PRIMARY_CONNECT_TIMEOUT_S = 5.0


def connect(url: str) -> aioredis.Redis:
    """The client for `url`: `redis://`, `rediss://`, `unix://`, `redis[s]+sentinel://` or `redis[s]+cluster://`."""
    if is_cluster_url(url):
        return _cluster(url)
    options = dict(
        max_connections=MAX_CONNECTIONS,
        timeout=CONNECTION_WAIT_S,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), RETRIES),
        retry_on_error=[ConnectionError, TimeoutError],
    )
    if is_sentinel_url(url):
        address = parse_sentinel_url(url)
        pool = BlockingSentinelConnectionPool(
            address.service, _sentinels(redis.asyncio.sentinel.Sentinel, address), **_primary_login(address), **options
        )
        return aioredis.Redis.from_pool(pool)  # closing the client closes the pool and its sentinel clients
    pool = aioredis.BlockingConnectionPool.from_url(url, **options)
    return aioredis.Redis(connection_pool=pool)


def connect_sync(url: str, **connection_options) -> redis.Redis:
    """A blocking client for one-off checks (lmq's start-up PING), any of `connect`'s URLs. It does not
    retry (a Sentinel set's primary and sentinel connections each retried with backoff: 13.7 s where the
    check's timeout was 2 s); the check itself says what failed."""
    if is_cluster_url(url):
        address = parse_cluster_url(url)
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in address.nodes]
        return redis.cluster.RedisCluster(
            startup_nodes=nodes,
            username=address.username,
            password=address.password,
            **_tls(address.tls),
            **connection_options,
        )
    connection_options = {"retry": redis.retry.Retry(NoBackoff(), 0), **connection_options}
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **connection_options)
    address = parse_sentinel_url(url)
    sentinels = _sentinels(redis.sentinel.Sentinel, address, retry=connection_options["retry"])
    return sentinels.master_for(address.service, **{**_primary_login(address), **connection_options})


async def pubsub(client: aioredis.Redis) -> aioredis.client.PubSub:
    """A pub/sub of `client`. A cluster client learns the slot map on its first command, and its
    pub/sub needs that map before it can pick a node: it is learnt first."""
    if isinstance(client, RedisCluster):
        await client.initialize()
    return client.pubsub()


class _RedisCluster(RedisCluster):
    """redis-py's cluster client, whose commands fail with a ConnectionError when their connection
    was closed under them: on a node's connection error redis-py 8.1 disconnects that node's
    connections, including those other tasks are using, and their commands then raise
    AttributeError (a writer that is None) instead."""

    async def execute_command(self, *args, **kwargs):
        try:
            return await super().execute_command(*args, **kwargs)
        except AttributeError as exc:
            raise ConnectionError(f"the connection was closed under the command ({exc})") from exc

    async def _determine_slot(self, command: str, *args):
        """XREAD and XREADGROUP routed by their streams' slot here. redis-py asks the server for the keys
        of a command whose keys move (COMMAND GETKEYS, a round trip to one node) before every such
        read: on a cluster with 6 workers, ~1,000 extra calls per 10k tokens, all on one node."""
        keys = stream_read_keys(command, args)
        if keys:
            slots = {self.keyslot(key) for key in keys}
            if len(slots) == 1:
                return slots.pop()
        return await super()._determine_slot(command, *args)


def stream_read_keys(command: str | bytes, args: tuple) -> list:
    """The stream keys of an XREAD or XREADGROUP (the first half of what follows STREAMS), else []."""
    name = command.decode() if isinstance(command, bytes) else str(command)
    first = {"XREAD": 0, "XREADGROUP": 3}.get(name.upper())  # XREADGROUP GROUP <group> <consumer> ...
    if first is None:
        return []
    words = [arg.decode() if isinstance(arg, bytes) else str(arg) for arg in args[first:]]
    upper = [word.upper() for word in words]
    if "STREAMS" not in upper:
        return []
    rest = args[first + upper.index("STREAMS") + 1 :]
    return list(rest[: len(rest) // 2]) if rest and len(rest) % 2 == 0 else []


def reply_text(value: bytes | str | None) -> str:
    """A reply's value as text: the clients here answer bytes; a str passes, None is ""."""
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _cluster(url: str) -> RedisCluster:
    address = parse_cluster_url(url)
    return _RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in address.nodes],
        username=address.username,
        password=address.password,
        **_tls(address.tls),
        max_connections=MAX_CLUSTER_CONNECTIONS,
        socket_timeout=CLUSTER_SOCKET_TIMEOUT_S,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), RETRIES),
        retry_on_error=[ConnectionError, TimeoutError],
    )


class BlockingSentinelConnectionPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """A pool of connections to the primary the sentinels name, that waits for a free one as
    `BlockingConnectionPool` does; it owns its sentinel clients and closes them with itself."""

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            await self.sentinel_manager.aclose()


def _sentinels(kind: type, address: SentinelAddress, **options):
    login = {"username": address.sentinel_username, "password": address.sentinel_password}
    timeouts = {"socket_timeout": SENTINEL_SOCKET_TIMEOUT_S, "socket_connect_timeout": SENTINEL_SOCKET_TIMEOUT_S}
    return kind(
        list(address.sentinels),
        min_other_sentinels=address.min_other_sentinels,
        sentinel_kwargs={**login, **timeouts, **_tls(address.tls), **options},
    )


def _primary_login(address: SentinelAddress) -> dict:
    """The primary's login, database and TLS (a pool takes `ssl=True` for its SSL connection class)."""
    login = {"db": address.db, "username": address.username, "password": address.password}
    return {**login, "socket_connect_timeout": PRIMARY_CONNECT_TIMEOUT_S, **_tls(address.tls)}


def _tls(options: TlsOptions | None) -> dict:
    return options.client_kwargs() if options else {}
