"""A Redis Cluster address written as one URL, so that `REDIS_URL` can name a cluster:

    redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...][/][?shards=K]
    rediss+cluster://...   the same over TLS, to every node

HOSTs are some of the cluster's nodes (any of them: the client learns the rest and the slot map
from the first that answers; an IPv6 address in brackets). `shards` is the number of request
shards (protocol/keys.py), 12 by default; every gateway, worker and producer of one deployment
must use the same number, since a request goes to the shard its id hashes to and workers read
K shards. Changing K means draining first. `rediss+cluster://` takes the TLS options of
protocol/tls_url.py (`&ssl_ca_certs=/certs/ca.pem&ssl_certfile=...&ssl_keyfile=...`); the nodes
then run with `tls-cluster yes`, so that the addresses they announce are their TLS ports.

Everything wrong is a ValueError that says what is wrong and shows the form, because lmq refuses
such a URL at start-up (lmq/checks.py) rather than at the first request.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

from protocol.keys import SINGLE, ShardLayout, sharded

from .tls_url import OPTIONS as TLS_OPTIONS
from .tls_url import TlsOptions, split_scheme, tls_options

SCHEME = "redis+cluster"
FORM = f"{SCHEME}://[:PASSWORD@]HOST:PORT[,HOST:PORT...][?shards=K] (rediss+cluster:// over TLS)"
DEFAULT_SHARDS = 12  # a multiple of 1, 2, 3, 4 and 6 primaries: the shards spread evenly over them


@dataclass(frozen=True)
class ClusterAddress:
    nodes: tuple[tuple[str, int], ...]
    shards: int = DEFAULT_SHARDS
    username: str | None = None
    password: str | None = None
    tls: TlsOptions | None = None  # None: plain TCP to every node


def is_cluster_url(url: str) -> bool:
    return split_scheme(url.split("://", 1)[0], SCHEME) is not None


def shard_layout(url: str) -> ShardLayout:
    """The key layout for a `REDIS_URL`: K shards for a cluster, the single-Redis names otherwise."""
    return sharded(parse_cluster_url(url).shards) if is_cluster_url(url) else SINGLE


def parse_cluster_url(url: str) -> ClusterAddress:
    """The parts of a `redis+cluster://` URL; ValueError naming what is wrong."""
    scheme, separator, rest = url.partition("://")
    tls = split_scheme(scheme, SCHEME) if separator else None
    if tls is None:
        raise ValueError(f"not a Redis Cluster URL (it starts with {SCHEME}:// or rediss+cluster://): {FORM}")
    rest, _, query = rest.partition("#")[0].partition("?")
    netloc, _, path = rest.partition("/")
    if path.strip("/"):
        raise ValueError(
            f"a Redis Cluster has one database: its URL has no path after the nodes (percent-encode a '/' in the password): {FORM}"
        )
    credentials, at, hosts = netloc.rpartition("@")
    user, colon, password = credentials.partition(":")
    nodes = tuple(_host_port(item) for item in hosts.split(","))
    options = _options(query)
    return ClusterAddress(
        nodes=nodes,
        shards=_shards(options.pop("shards", [str(DEFAULT_SHARDS)])),
        tls=tls_options({name: values[0] for name, values in options.items()}, tls, SCHEME),
        username=(unquote(user) or None) if at else None,
        password=unquote(password) if at and colon else None,
    )


def _host_port(item: str) -> tuple[str, int]:
    if item.startswith("["):  # [::1]:7000
        host, _, port = item[1:].partition("]")
        port = port[1:] if port.startswith(":") else ""
    else:
        host, _, port = item.partition(":")
    if not host or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"cluster node {item!r}: each node is HOST:PORT, comma-separated: {FORM}")
    return host, int(port)


def _options(query: str) -> dict[str, list[str]]:
    try:
        given = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(
            "the options of a Redis Cluster URL are name=value pairs joined by &"
        ) from None  # no echo: a password may be in it
    unknown = sorted(set(given) - {"shards", *TLS_OPTIONS})
    if unknown:
        raise ValueError(
            f"unknown Redis Cluster URL option {unknown[0]!r}: the options are shards; ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_check_hostname with rediss+cluster://"
        )
    repeated = [
        name for name, values in given.items() if len(values) > 1 and name != "shards"
    ]  # shards: its own message
    if repeated:
        raise ValueError(f"Redis Cluster URL option {repeated[0]!r} is given more than once")
    return given


def _shards(values: list[str]) -> int:
    if len(values) > 1 or not (values[0].isascii() and values[0].isdigit()) or not 1 <= int(values[0]) <= 1024:
        raise ValueError(f"shards is one number from 1 to 1024, not {','.join(values)!r}")
    return int(values[0])
