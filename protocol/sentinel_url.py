"""A Redis Sentinel address written as one URL, so that `REDIS_URL` can name a failover set:

    redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB][?OPTIONS]
    rediss+sentinel://...   the same over TLS, to the primary and to the sentinels

HOSTs are the sentinels (port 26379 unless given; an IPv6 address in brackets), SERVICE is the
name the sentinels monitor (`sentinel monitor SERVICE ...`), DB the database (0). USER and
PASSWORD log in to the primary, as in a `redis://` URL; the sentinels themselves take
`?sentinel_username=...&sentinel_password=...` (sentinels often have no password, or another
one). `?min_other_sentinels=N` trusts only a sentinel that sees N others, so that one cut off
from its peers cannot hand out a stale primary. `rediss+sentinel://` takes the TLS options
of protocol/tls_url.py (`?ssl_ca_certs=/certs/ca.pem&ssl_certfile=...&ssl_keyfile=...`), the same
for the sentinels as for the primary: sentinels of a TLS set listen on their own `tls-port`.

redis-py connects through sentinels but has no URL for them; this is the only place that reads
one. Everything wrong is a ValueError that says what is wrong and shows the form, because lmq
refuses such a URL at start-up (lmq/checks.py) rather than at the first request.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

from .tls_url import OPTIONS as TLS_OPTIONS
from .tls_url import TlsOptions, split_scheme, tls_options

SCHEME = "redis+sentinel"
DEFAULT_PORT = 26379
FORM = f"{SCHEME}://[:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB] (rediss+sentinel:// over TLS)"
OPTIONS = ("sentinel_username", "sentinel_password", "min_other_sentinels")
TLS_ONLY = "ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_check_hostname with rediss+sentinel://"


@dataclass(frozen=True)
class SentinelAddress:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None  # of the primary
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    min_other_sentinels: int = 0
    tls: TlsOptions | None = None  # None: plain TCP to the sentinels and the primary


def is_sentinel_url(url: str) -> bool:
    return split_scheme(url.split("://", 1)[0], SCHEME) is not None


def parse_sentinel_url(url: str) -> SentinelAddress:
    """The parts of a `redis+sentinel://` URL; ValueError naming what is wrong."""
    scheme, separator, rest = url.partition("://")
    tls = split_scheme(scheme, SCHEME) if separator else None
    if tls is None:
        raise ValueError(f"not a Sentinel URL (it starts with {SCHEME}:// or rediss+sentinel://): {FORM}")
    rest = rest.partition("#")[0]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    credentials, at, hosts = netloc.rpartition("@")
    username, password = _credentials(credentials) if at else (None, None)
    service, db = _service_and_db(path)
    return SentinelAddress(
        sentinels=tuple(_host_port(item) for item in _items(hosts)),
        service=service,
        db=db,
        username=username,
        password=password,
        **_options(query, tls),
    )


def _credentials(text: str) -> tuple[str | None, str | None]:
    user, colon, password = text.partition(":")
    return unquote(user) or None, unquote(password) if colon else None


def _items(hosts: str) -> list[str]:
    items = hosts.split(",")
    if not hosts or not all(items):
        raise ValueError(f"a Sentinel URL names its sentinels, comma-separated, none empty: {FORM}")
    return items


def _host_port(item: str) -> tuple[str, int]:
    if item.startswith("["):  # [::1]:26379
        host, bracket, port = item[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            raise ValueError(f"sentinel {item!r}: an IPv6 address goes in brackets, [::1]:26379")
        port = port[1:]
    else:
        host, _, port = item.partition(":")
    if not host:
        raise ValueError(f"sentinel {item!r} has no host: {FORM}")
    if not port:
        return host, DEFAULT_PORT
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"sentinel {item!r}: the port must be a number from 1 to 65535")
    return host, int(port)


def _service_and_db(path: str) -> tuple[str, int]:
    parts = path.split("/")
    if parts and parts[-1] == "":
        parts.pop()  # a trailing slash
    if not parts or not parts[0] or len(parts) > 2:
        raise ValueError(f"a Sentinel URL names the service its sentinels monitor, then perhaps a database: {FORM}")
    service = unquote(parts[0])
    if len(parts) == 1:
        return service, 0
    if not parts[1].isdigit():
        raise ValueError(f"the database in a Sentinel URL is a number, not {parts[1]!r}: {FORM}")
    return service, int(parts[1])


def _options(query: str, tls: bool) -> dict:
    try:
        given = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(
            "the options of a Sentinel URL are name=value pairs joined by &"
        ) from None  # no echo: a password may be in it
    unknown = sorted(set(given) - set(OPTIONS) - set(TLS_OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown Sentinel URL option {unknown[0]!r}: the options are {', '.join(OPTIONS)}; {TLS_ONLY}"
        )
    repeated = [name for name, values in given.items() if len(values) > 1]
    if repeated:
        raise ValueError(f"Sentinel URL option {repeated[0]!r} is given more than once")
    options: dict = {name: values[0] or None for name, values in given.items()}
    options["tls"] = tls_options(options, tls, SCHEME)
    if "min_other_sentinels" in options:
        value = options["min_other_sentinels"] or ""
        if not value.isdigit():
            raise ValueError(f"min_other_sentinels is a number of sentinels, not {value!r}")
        options["min_other_sentinels"] = int(value)
    return options
