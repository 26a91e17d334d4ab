"""Running lmq's parts: `lmq serve` (embedded Redis, one worker and one gateway in one process,
stopped together), and the start-up steps `lmq gateway` and `lmq worker` share with it.

A start that cannot succeed fails fast, before slow work where it can, with one line that names
the problem (`FatalError`, or a known error `explain` turns into one): settings are checked by
lmq/cli.py before anything starts; Redis is pinged before the model loads; the gateway binds its
port before the model loads. `lmq serve` exits, non-zero, as soon as any of its parts dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import signal
import socket
import time
from urllib.parse import urlsplit, urlunsplit

from gateway.config import GatewayConfig
from protocol.cancelling import cancel_and_wait
from worker.config import WorkerConfig

from .redis_server import EmbeddedRedis

log = logging.getLogger("lmq.serve")

READY_TIMEOUT_S = 600.0  # the first start may dequantize a large model
REDIS_CHECK_TIMEOUT_S = 5.0
STOP_WAITS_S = (10.0, 5.0)  # on the way out, how long the parts get to stop after a cancel, and after a second one
REDIS_WATCH_S = 0.5
_LISTEN_ERRORS = (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL)


class FatalError(Exception):
    """lmq cannot go on; the message is the one line it ends with."""


# ---------------------------------------------------------------- explaining failures in one line


def redacted(url: str) -> str:
    """`url` without its passwords (a Sentinel URL's sentinels may have one of their own)."""
    url = re.sub(r"([?&]sentinel_password=)[^&#]*", r"\1***", url)
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user_info, _, host = parts.netloc.rpartition("@")
        user = user_info.partition(":")[0]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:
        return "<REDIS_URL>"


def explain(exc: BaseException) -> str | None:
    """One line for a failure lmq knows how to describe; None for anything else (a bug)."""
    import redis.exceptions as redis_errors

    if isinstance(exc, FatalError):
        return str(exc)
    if isinstance(exc, redis_errors.NoPermissionError):
        return (
            f"the Redis user in REDIS_URL lacks a permission lmq needs ({exc}); docs/deploy.md has the ACL to give it"
        )
    if isinstance(exc, redis_errors.AuthenticationError):
        return f"Redis refused the login in REDIS_URL: {exc}"
    if isinstance(exc, (redis_errors.ConnectionError, redis_errors.TimeoutError)):
        return f"lost the connection to Redis: {exc}"
    if isinstance(exc, OSError) and exc.errno in _LISTEN_ERRORS:
        return f"cannot listen: {exc}"
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(exc):
        # Python's own allocator (the page pool's free list), torch's CUDA and CPU allocators
        return f"out of memory: {_message(exc)} (lower LMQ_KV_MEMORY or LMQ_MAX_SEQS)"
    return None


def _message(exc: BaseException) -> str:
    return str(exc).strip() or type(exc).__name__


# ---------------------------------------------------------------- start-up steps


def check_redis(url: str, channels: tuple[str, ...] = (), timeout: float = REDIS_CHECK_TIMEOUT_S) -> None:
    """PING the Redis at `url` and subscribe to `channels` (the process's own: a refused SUBSCRIBE
    would otherwise show only later); FatalError naming the problem if it does not answer as it should."""
    import redis.exceptions as redis_errors
    from redis.sentinel import MasterNotFoundError

    from protocol.redis_client import connect_sync

    where = redacted(url)
    try:
        client = connect_sync(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    except ValueError as exc:
        raise FatalError(f"REDIS_URL {where!r} is not a Redis URL: {exc}") from exc
    except redis_errors.RedisClusterException as exc:  # a cluster client asks its nodes for the slot map as it is made
        raise FatalError(f"cannot reach Redis at {where}: {_message(exc)}{_tls_hint(exc)}") from exc
    try:
        client.ping()
        if channels:
            _check_subscribe(client, channels, timeout)
    except redis_errors.AuthenticationError as exc:
        if _login_options(client).get("password") is None:
            raise FatalError(
                f"Redis at {where} needs a password and REDIS_URL has none (redis://:PASSWORD@host:port/0)"
            ) from exc
        raise FatalError(f"Redis at {where} refused the login in REDIS_URL: {_message(exc)}") from exc
    except redis_errors.AuthenticationWrongNumberOfArgsError as exc:
        raise FatalError(f"REDIS_URL has a password but Redis at {where} has none: {_message(exc)}") from exc
    except redis_errors.NoPermissionError as exc:
        raise FatalError(
            f"the Redis user in REDIS_URL lacks a permission lmq needs at {where}: {_message(exc)} (docs/deploy.md has the ACL to give it)"
        ) from exc
    except MasterNotFoundError as exc:
        raise FatalError(f"cannot reach Redis at {where}: {_no_primary(url)}") from exc
    except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
        raise FatalError(f"cannot reach Redis at {where}: {_message(exc)}{_tls_hint(exc)}") from exc
    except redis_errors.RedisError as exc:
        raise FatalError(f"Redis at {where} refused PING: {_message(exc)}") from exc
    finally:
        client.close()


def _login_options(client) -> dict:
    pool = getattr(client, "connection_pool", None)  # a cluster client has a pool per node instead
    return pool.connection_kwargs if pool is not None else client.nodes_manager.connection_kwargs


def _no_primary(url: str) -> str:
    """One line for a Sentinel set that named no primary (redis-py's message repeats every client's settings)."""
    from protocol.sentinel_url import parse_sentinel_url

    address = parse_sentinel_url(url)
    asked = ", ".join(f"{host}:{port}" for host, port in address.sentinels)
    found = f"no sentinel names a primary for {address.service!r} that is up (asked {asked}: down, unreachable, or not monitoring it)"
    refusal = _sentinel_refusal(address)
    return f"{found}; {refusal}{_tls_hint(refusal)}" if refusal else found


def _sentinel_refusal(address) -> str:
    """Why the first sentinel that cannot be reached cannot be, in redis-py's words (its
    MasterNotFoundError names each sentinel's error only by its class); "" when all answer."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from protocol.redis_client import SENTINEL_SOCKET_TIMEOUT_S

    tls = address.tls.client_kwargs() if address.tls else {}
    timeouts = {"socket_timeout": SENTINEL_SOCKET_TIMEOUT_S, "socket_connect_timeout": SENTINEL_SOCKET_TIMEOUT_S}
    for host, port in address.sentinels:
        login = {"username": address.sentinel_username, "password": address.sentinel_password}
        client = redis.Redis(host, port, **login, **tls, **timeouts, retry=Retry(NoBackoff(), 0))
        try:
            client.ping()
        except redis.RedisError as exc:
            return f"sentinel {host}:{port}: {_message(exc)}"
        finally:
            client.close()
    return ""


def _tls_hint(exc: BaseException) -> str:
    """What a refused certificate means, with redis-py's reason (for a Sentinel set it is buried
    in a list of every sentinel's error, which _no_primary leaves out)."""
    found = re.search(r"\[SSL: CERTIFICATE_VERIFY_FAILED\][^(.]*", str(exc))
    if not found:
        return ""
    return f"; TLS refused the server's certificate ({found.group(0).strip()}): ssl_ca_certs must name the CA that signed it, and it must name the address connected to"


def _check_subscribe(client, channels: tuple[str, ...], timeout: float) -> None:
    pubsub = client.pubsub()
    try:
        pubsub.subscribe(*channels)
        deadline = time.monotonic() + timeout
        confirmed = 0
        while confirmed < len(channels) and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=max(deadline - time.monotonic(), 0.01))  # a refusal raises here
            confirmed += bool(message and message["type"] == "subscribe")
        pubsub.unsubscribe()
    finally:
        pubsub.close()


async def run_gateway_part(config: GatewayConfig, listening: asyncio.Event | None = None) -> None:
    """The gateway until cancelled; a port it cannot bind is a FatalError that names it."""
    from gateway.app import run_gateway

    bound = listening or asyncio.Event()
    try:
        await run_gateway(config, listening=bound)
    except OSError as exc:
        unknown_host = isinstance(exc, socket.gaierror)
        if bound.is_set() or not (unknown_host or exc.errno in _LISTEN_ERRORS):
            raise
        if exc.errno == errno.EADDRINUSE:
            reason = "the port is in use (another process listens there: choose another with --port or PORT)"
        elif unknown_host:
            reason = f"unknown host ({exc.strerror})"
        else:
            reason = os.strerror(exc.errno)
        raise FatalError(f"cannot listen on {config.host}:{config.port}: {reason}") from exc


async def run_worker_part(config: WorkerConfig, stop: asyncio.Event | None = None) -> None:
    """Load the model (a failure is a FatalError naming it), then run the worker until `stop`
    (by default, until SIGTERM)."""
    import torch

    from worker import compute_thread
    from worker.model.loader import load_model
    from worker.service import run_worker

    if config.threads > 0:
        torch.set_num_threads(config.threads)  # before the torch thread starts: it keeps this count
    log.info(
        "loading the model %s (dtype %s, quant %s, device %s)",
        config.model or "(the default)",
        config.dtype,
        config.quant,
        config.device,
    )
    try:
        model = await compute_thread.run_async(
            load_model,
            config.model or None,
            dtype=config.dtype,
            quant=config.quant,
            device=config.device,
            cpu_steps=config.cpu_steps,
        )
    except Exception as exc:
        raise FatalError(f"cannot load the model {config.model or '(the default)'}: {_message(exc)}") from exc
    if stop is not None and stop.is_set():
        return
    await run_worker(config, model=model, stop=stop)


# ---------------------------------------------------------------- lmq serve


def serve(gateway_config: GatewayConfig, worker_config: WorkerConfig, *, redis_url_given: bool) -> int:
    """Run everything until a signal (0 once drained) or until a part dies (FatalError)."""
    redis = None
    if redis_url_given:
        from protocol import CANCEL_CHANNEL, gateway_reply_channel

        check_redis(gateway_config.redis_url, (gateway_reply_channel(gateway_config.gateway_id), CANCEL_CHANNEL))
    else:
        try:
            # Its own temporary directory: two `lmq serve` never share a socket, and nothing is
            # left in the working directory.
            redis = EmbeddedRedis().start()
        except (RuntimeError, OSError) as exc:
            raise FatalError(f"cannot start the embedded Redis: {_message(exc)}") from exc
        print(f"lmq: embedded Redis at {redis.url}", flush=True)
        gateway_config.redis_url = worker_config.redis_url = redis.url
    try:
        asyncio.run(_serve(gateway_config, worker_config, redis))
        return 0
    finally:
        if redis:
            redis.stop()
            print("lmq: stopped", flush=True)


async def _serve(gateway_config: GatewayConfig, worker_config: WorkerConfig, redis: EmbeddedRedis | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stop_or_force, stop)

    listening = asyncio.Event()
    parts = [asyncio.create_task(run_gateway_part(gateway_config, listening), name="gateway")]
    if redis is not None:
        parts.append(asyncio.create_task(_watch(redis), name="embedded Redis"))
    stopping = asyncio.create_task(stop.wait(), name="stop")
    ready = None
    try:
        # The port first, so that one in use fails at once rather than after the model loaded.
        bound = asyncio.create_task(listening.wait(), name="listening")
        await asyncio.wait([*parts, bound, stopping], return_when=asyncio.FIRST_COMPLETED)
        bound.cancel()
        _raise_for(parts, stop)
        if stop.is_set():
            return
        url = f"http://{gateway_config.host}:{gateway_config.port}"
        print(f"lmq: gateway listening on {url}", flush=True)
        # On a signal the worker drains (finishes what it runs, within its grace period) while the
        # gateway still relays those answers; then the gateway goes too.
        worker = asyncio.create_task(run_worker_part(worker_config, stop=stop), name="worker")
        parts.append(worker)
        ready = asyncio.create_task(_announce_ready(url), name="ready")
        while True:
            await asyncio.wait(parts, return_when=asyncio.FIRST_COMPLETED)
            _raise_for(parts, stop)
            if worker.done():
                return  # drained after a signal
    finally:
        stopping.cancel()
        await _cancel_all([task for task in (*parts, ready) if task is not None])


def _raise_for(parts: list[asyncio.Task], stop: asyncio.Event) -> None:
    """A part that ended: its error, or 'stopped unexpectedly' (only the worker ends, after a stop)."""
    for task in parts:
        if not task.done():
            continue
        if task.cancelled():
            raise FatalError(f"the {task.get_name()} was cancelled")
        exc = task.exception()
        if exc is not None:
            if explain(exc) is None:
                log.error("the %s failed", task.get_name(), exc_info=exc)
                raise FatalError(f"the {task.get_name()} failed: {type(exc).__name__}: {_message(exc)}") from exc
            raise exc
        if not (task.get_name() == "worker" and stop.is_set()):
            raise FatalError(f"the {task.get_name()} stopped unexpectedly")


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancel and wait, cancelling again a task still running after a while (protocol/cancelling.py),
    then give up on it rather than hang."""
    for task in await cancel_and_wait(tasks, STOP_WAITS_S):
        log.warning("the %s did not stop within %.0f s", task.get_name(), sum(STOP_WAITS_S))


async def _watch(redis: EmbeddedRedis) -> None:
    """Ends (with the reason) when the embedded Redis exits."""
    while redis.process is not None and redis.process.poll() is None:
        await asyncio.sleep(REDIS_WATCH_S)
    code = redis.process.returncode if redis.process is not None else None
    how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
    raise FatalError(f"the embedded Redis stopped ({how}); lmq cannot work without it")


def _stop_or_force(stop: asyncio.Event) -> None:
    """The first Ctrl-C drains; a second one stops at once."""
    if stop.is_set():
        raise KeyboardInterrupt
    print("lmq: stopping (finishing running requests; Ctrl-C again to stop now)", flush=True)
    stop.set()


async def _announce_ready(url: str) -> None:
    """Print the ready line once the gateway sees a live worker."""
    import aiohttp

    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while time.monotonic() - started < READY_TIMEOUT_S:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{url}/ready") as response:
                    if response.status == 200:
                        async with session.get(f"{url}/v1/models") as models:
                            names = [m["id"] for m in (await models.json())["data"]]
                        print(f"lmq: ready — model {', '.join(names)} at {url}/v1 (Ctrl-C stops)", flush=True)
                        return
            await asyncio.sleep(0.25)
    log.warning("no worker became ready within %.0f s", READY_TIMEOUT_S)
