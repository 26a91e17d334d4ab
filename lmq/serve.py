"""`lmq serve`: embedded Redis, one worker and one gateway in one process, stopped together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

import aiohttp

from gateway.config import GatewayConfig
from worker.config import WorkerConfig

from .redis_server import EmbeddedRedis

log = logging.getLogger("lmq.serve")

READY_TIMEOUT_S = 600.0  # the first start may dequantize a large model


def serve(gateway_config: GatewayConfig, worker_config: WorkerConfig, *, redis_url_given: bool) -> int:
    redis = None
    if not redis_url_given:
        redis = EmbeddedRedis(data_dir=".lmq/redis").start()
        print(f"lmq: embedded Redis at {redis.url}", flush=True)
        gateway_config.redis_url = worker_config.redis_url = redis.url
    try:
        return asyncio.run(_serve(gateway_config, worker_config))
    finally:
        if redis:
            redis.stop()
            print("lmq: stopped", flush=True)


async def _serve(gateway_config: GatewayConfig, worker_config: WorkerConfig) -> int:
    from gateway.app import run_gateway
    from worker.service import run_worker

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stop_or_force, stop)

    # On a signal the worker drains (finishes what it runs, within its grace period) while the
    # gateway still relays those answers; then the gateway goes too.
    worker = asyncio.create_task(run_worker(worker_config, stop=stop), name="worker")
    gateway = asyncio.create_task(run_gateway(gateway_config), name="gateway")
    url = f"http://{gateway_config.host}:{gateway_config.port}"
    print(f"lmq: gateway listening on {url}", flush=True)
    ready = asyncio.create_task(_announce_ready(url))
    await asyncio.wait([worker, gateway], return_when=asyncio.FIRST_COMPLETED)
    for task in (worker, gateway, ready):
        task.cancel()
    await asyncio.gather(worker, gateway, ready, return_exceptions=True)
    failed = [t for t in (worker, gateway) if not t.cancelled() and t.exception()]
    for task in failed:
        log.error("%s failed", task.get_name(), exc_info=task.exception())
    return 1 if failed else 0


def _stop_or_force(stop: asyncio.Event) -> None:
    """The first Ctrl-C drains; a second one stops at once."""
    if stop.is_set():
        raise KeyboardInterrupt
    print("lmq: stopping (finishing running requests; Ctrl-C again to stop now)", flush=True)
    stop.set()


async def _announce_ready(url: str) -> None:
    """Print the ready line once the gateway sees a live worker."""
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
