"""The `lmq` command: serve (all-in-one), gateway, worker."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

from gateway.config import GatewayConfig
from worker.config import WorkerConfig

from .settings import add_flags, build


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmq", description="Chat-model inference behind a Redis message queue.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="all in one: embedded Redis (unless REDIS_URL is set), one worker, one gateway")
    add_flags(serve, GatewayConfig)
    add_flags(serve, WorkerConfig)

    gateway = commands.add_parser("gateway", help="the HTTP gateway (OpenAI and Anthropic APIs)")
    add_flags(gateway, GatewayConfig)

    worker = commands.add_parser("worker", help="a worker: reads requests from Redis, runs the model")
    add_flags(worker, WorkerConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        gateway_config = build(GatewayConfig, args) if args.command in ("serve", "gateway") else None
        worker_config = build(WorkerConfig, args) if args.command in ("serve", "worker") else None
    except ValueError as exc:
        parser.error(str(exc))
    try:
        if args.command == "serve":
            from .serve import serve

            return serve(gateway_config, worker_config, redis_url_given=_redis_url_given(args))
        if args.command == "gateway":
            from gateway.app import run_gateway

            asyncio.run(_until_signal(run_gateway(gateway_config)))
        elif args.command == "worker":
            from worker.service import run_worker

            asyncio.run(run_worker(worker_config))
    except KeyboardInterrupt:
        pass
    return 0


async def _until_signal(coroutine) -> None:
    """Run until SIGINT or SIGTERM, then cancel, so cleanup code runs."""
    task = asyncio.ensure_future(coroutine)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _redis_url_given(args: argparse.Namespace) -> bool:
    return bool(args.redis_url or os.environ.get("REDIS_URL"))


if __name__ == "__main__":
    sys.exit(main())
