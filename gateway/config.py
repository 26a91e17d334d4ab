"""Gateway settings. Each field is also a CLI flag (`--max-queue`) and an env var (`LMQ_MAX_QUEUE`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass
class GatewayConfig:
    redis_url: str = field(default="redis://localhost:6379/0", metadata={"help": "Redis to enqueue requests into", "env": "REDIS_URL"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on", "env": "PORT"})
    api_keys: str = field(default="", metadata={"help": "comma-separated API keys; empty = no auth"})
    api_keys_file: str = field(default="", metadata={"help": "file with one API key a line"})
    max_queue: int = field(default=256, metadata={"help": "waiting requests per model stream above which new ones get 429"})
    request_timeout: float = field(default=600.0, metadata={"help": "seconds a request may take in all"})
    pickup_timeout: float = field(default=60.0, metadata={"help": "seconds to wait for a worker to start a request"})
    max_body_bytes: int = field(default=4 << 20, metadata={"help": "largest request body accepted"})
    retry_after: int = field(default=2, metadata={"help": "seconds in Retry-After when the queue is full"})
    keepalive_seconds: float = field(default=5.0, metadata={"help": "idle seconds between keep-alives on a stream (Anthropic `ping`)"})
    default_max_tokens: int = field(default=512, metadata={"help": "max_tokens when a request gives none"})
    allowed_origins: str = field(default="", metadata={"help": "comma-separated origins whose pages may call the API (CORS), `*` for any; empty = none"})
    gateway_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12], metadata={"help": "unique id; names this gateway's reply channel"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})
    log_format: str = field(default="text", metadata={"help": "text, or json: one JSON object a line"})
    otlp_endpoint: str = field(default="", metadata={"help": "OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces); empty = tracing off"})
