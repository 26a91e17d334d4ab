"""The `lmq` command: serve (all-in-one), gateway, worker.

A start that cannot succeed ends with one line on stderr naming the problem and a non-zero exit
(2 for a setting, 1 for anything else); `--log-level DEBUG` adds the details behind it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

from gateway.config import GatewayConfig
from protocol.tracing import setup_tracing
from worker.config import WorkerConfig

from . import logs
from .checks import check_gateway, check_worker
from .settings import add_flags, build

log = logging.getLogger("lmq")

# Settings every command reads; given before the subcommand (`lmq --log-level DEBUG serve`) or after it.
_GLOBAL = {"log_level": "LMQ_LOG_LEVEL", "log_format": "LMQ_LOG_FORMAT"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmq", description="Chat-model inference behind a Redis message queue.")
    # Their own dest: a subcommand's flags of the same name would overwrite these with None.
    parser.add_argument(
        "--log-level",
        dest="global_log_level",
        metavar="LOG_LEVEL",
        help="DEBUG, INFO, WARNING, ERROR [env LMQ_LOG_LEVEL]",
    )
    parser.add_argument(
        "--log-format",
        dest="global_log_format",
        metavar="LOG_FORMAT",
        help="text, or json: one JSON object a line [env LMQ_LOG_FORMAT]",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="all in one: embedded Redis (unless REDIS_URL is set), one worker, one gateway"
    )
    add_flags(serve, GatewayConfig)
    add_flags(serve, WorkerConfig)

    gateway = commands.add_parser("gateway", help="the HTTP gateway (OpenAI and Anthropic APIs)")
    add_flags(gateway, GatewayConfig)

    worker = commands.add_parser("worker", help="a worker: reads requests from Redis, runs the model")
    add_flags(worker, WorkerConfig)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the log flags given before the subcommand where none came after it."""
    args = _parser().parse_args(argv)
    for name in _GLOBAL:
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(args, f"global_{name}"))
    return args


def log_settings(args: argparse.Namespace, environ: dict[str, str] | None = None) -> tuple[str, str]:
    """(level, format): flag over LMQ_LOG_LEVEL / LMQ_LOG_FORMAT over INFO / text; ValueError if unusable."""
    environ = os.environ if environ is None else environ
    level = logs.check_level(args.log_level or environ.get(_GLOBAL["log_level"]) or "INFO")
    fmt = logs.check_format(args.log_format or environ.get(_GLOBAL["log_format"]) or "text")
    return level, fmt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        logs.setup(*log_settings(args))
        gateway_config = worker_config = None
        if args.command in ("serve", "gateway"):
            gateway_config = build(GatewayConfig, args)
            check_gateway(gateway_config)
        if args.command in ("serve", "worker"):
            worker_config = build(WorkerConfig, args)
            check_worker(worker_config)
    except ValueError as exc:
        logs.fatal(str(exc))
        return 2
    config = gateway_config or worker_config
    setup_tracing(f"lmq-{args.command}", config.otlp_endpoint)
    try:
        return _run(args, gateway_config, worker_config)
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # noqa: BLE001 - the last line must name any failure
        return _report(exc)


def _run(args: argparse.Namespace, gateway_config: GatewayConfig | None, worker_config: WorkerConfig | None) -> int:
    from protocol import CANCEL_CHANNEL, gateway_reply_channel

    from .serve import check_redis, run_gateway_part, run_worker_part, serve

    if args.command == "serve":
        return serve(gateway_config, worker_config, redis_url_given=_redis_url_given(args))
    if args.command == "gateway":
        check_redis(gateway_config.redis_url, (gateway_reply_channel(gateway_config.gateway_id),))
        asyncio.run(_until_signal(run_gateway_part(gateway_config)))
    elif args.command == "worker":
        check_redis(worker_config.redis_url, (CANCEL_CHANNEL,))  # before the model loads: a wrong URL fails in a second
        asyncio.run(run_worker_part(worker_config))
    return 0


def _report(exc: Exception) -> int:
    """The last line names the failure; a known one's details (and an unknown one's traceback) go to the log."""
    from .serve import explain

    message = explain(exc)
    if message is None:
        log.error("stopped by an unexpected error", exc_info=exc)
        message = f"{type(exc).__name__}: {str(exc).strip()}"
    else:
        log.debug("details", exc_info=exc)
    logs.fatal(message)
    return 1


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
