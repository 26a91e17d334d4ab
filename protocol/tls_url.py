"""TLS in a Sentinel or Cluster URL: the `rediss+` schemes and the options they take.

`rediss+sentinel://` and `rediss+cluster://` are `redis+sentinel://` and `redis+cluster://` over
TLS, as `rediss://` is `redis://` over TLS. They take the options a `rediss://` URL gives redis-py
for the same purpose, under the same names:

    ssl_ca_certs=PATH       the CA (PEM) that signed the servers' certificates (default: the system's)
    ssl_certfile=PATH       a client certificate (PEM), for servers that ask for one (tls-auth-clients)
    ssl_keyfile=PATH        its private key (PEM); given with ssl_certfile, never alone
    ssl_check_hostname=no   accept a certificate that does not name the address connected to (yes)

The servers' certificates are always verified: there is no option to turn verification off,
since a Sentinel or Cluster client connects to addresses the servers announce, and an unverified
TLS connection to an announced address is no protection against whoever can announce one. Over
TLS, every connection is TLS: to the primary and to the sentinels (which then listen with their
own `tls-port`), to every cluster node. The options without the `rediss+` scheme are refused
rather than ignored, so that a URL never looks encrypted when it is not.
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
_YES, _NO = ("yes", "true", "1"), ("no", "false", "0")


@dataclass(frozen=True)
class TlsOptions:
    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    check_hostname: bool = True

    def client_kwargs(self) -> dict:
        """redis-py's keyword arguments for these options (a Redis, Sentinel or RedisCluster client)."""
        return {
            "ssl": True,
            "ssl_ca_certs": self.ca_certs,
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_check_hostname": self.check_hostname,
            "ssl_cert_reqs": "required",
        }


def split_scheme(scheme: str, plain: str) -> bool | None:
    """Whether `scheme` is `plain` over TLS (`rediss+...` for `redis+...`): True, False, or None
    when it is neither."""
    scheme = scheme.lower()
    if scheme == plain:
        return False
    if scheme == "rediss" + plain.removeprefix("redis"):
        return True
    return None


def tls_options(given: dict[str, str | None], tls: bool, scheme: str) -> TlsOptions | None:
    """The TLS options among a URL's `given` options (which are taken out of it), None without TLS.
    `scheme` is the plain one (`redis+sentinel`), named in the error when TLS options come without TLS."""
    found = {name: given.pop(name) for name in OPTIONS if name in given}
    if not tls:
        if found:
            raise ValueError(
                f"{next(iter(found))} is a TLS option: a URL over TLS starts with rediss{scheme.removeprefix('redis')}://"
            )
        return None
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if name in found and not found[name]:
            raise ValueError(f"{name} is the path of a PEM file, not empty")
    if bool(found.get("ssl_certfile")) != bool(found.get("ssl_keyfile")):
        raise ValueError("ssl_certfile and ssl_keyfile come together: a client certificate and its private key")
    check = (found.get("ssl_check_hostname") or "yes").lower()
    if check not in _YES + _NO:
        raise ValueError(f"ssl_check_hostname is yes or no, not {check!r}")
    return TlsOptions(found.get("ssl_ca_certs"), found.get("ssl_certfile"), found.get("ssl_keyfile"), check in _YES)
