"""Logging for every lmq process: one record a line on stderr, as text or as JSON.

    setup("INFO", "text")   # 2026-11-30 12:03:47,059 INFO gateway.access: request_id=... status=200 ...
    setup("INFO", "json")   # {"time": "2026-11-30T12:03:47.059Z", "level": "INFO", "logger": "gateway.access", ...}

In JSON every `extra=` field of a record (request_id, status, ...) is a key of its own, so a log
pipeline can filter on it without parsing the message. `fatal(message)` writes the one line a
failed start ends with (`lmq: error: ...`, or a JSON object).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import TextIO

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The attributes every LogRecord has; anything else on a record came in through `extra=`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
_format = "text"
_handler: logging.Handler | None = None


def check_level(text: str) -> str:
    level = text.strip().upper()
    level = "WARNING" if level == "WARN" else level
    if level not in LEVELS:
        raise ValueError(f"LMQ_LOG_LEVEL (--log-level) must be one of {', '.join(LEVELS)}, not {text!r}")
    return level


def check_format(text: str) -> str:
    fmt = text.strip().lower()
    if fmt not in FORMATS:
        raise ValueError(f"LMQ_LOG_FORMAT (--log-format) must be text or json, not {text!r}")
    return fmt


def _timestamp(created: float) -> str:
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC), level, logger, message, every `extra` field, exception."""

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "time": _timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_") and key not in data:
                data[key] = value
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            data["stack"] = self.formatStack(record.stack_info)
        return json.dumps(data, ensure_ascii=False, default=str)


def setup(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Send every logger's records to `stream` (stderr) in `fmt`; calling it again replaces the set-up."""
    global _format, _handler
    _format = check_format(fmt)
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    _handler = logging.StreamHandler(stream or sys.stderr)
    _handler.setFormatter(JsonFormatter() if _format == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(_handler)
    root.setLevel(check_level(level))
    # gateway/access_log.py writes the access lines (with the request id, tokens and timings).
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.captureWarnings(True)


def fatal(message: str, stream: TextIO | None = None) -> None:
    """The last line of a process that cannot go on: it names the problem, on one line."""
    message = " ".join(message.split())  # one line, whatever the exception's text held
    stream = stream or sys.stderr
    if _format == "json":
        line = json.dumps(
            {"time": _timestamp(datetime.now().timestamp()), "level": "ERROR", "logger": "lmq", "message": message}
        )
    else:
        line = f"lmq: error: {message}"
    print(line, file=stream, flush=True)
