"""Gateway settings. Each field is also a CLI flag (`--max-queue`) and an env var (`LMQ_MAX_QUEUE`)."""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field
from typing import Any

import protocol


@dataclass
class GatewayConfig:
    redis_url: str = field(
        default="redis://localhost:6379/0", metadata={"help": "Redis to enqueue requests into", "env": "REDIS_URL"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on", "env": "PORT"})
    api_keys: str = field(default="", metadata={"help": "comma-separated API keys; empty = no auth"})
    api_keys_file: str = field(default="", metadata={"help": "file with one API key a line"})
    max_queue: int = field(
        default=256, metadata={"help": "waiting requests per model stream above which new ones get 429"}
    )
    max_queue_per_key: int = field(
        default=64,
        metadata={
            "help": "entries (choices x prompts) one API key may have waiting in the queue at once, across gateways; 0 = no cap"
        },
    )
    request_timeout: float = field(default=600.0, metadata={"help": "seconds a request may take in all"})
    pickup_timeout: float = field(default=60.0, metadata={"help": "seconds to wait for a worker to start a request"})
    resume_timeout: float = field(
        default=15.0,
        metadata={
            "help": "seconds an open request, batch item or background response waits, after its connection to Redis broke (a restart, a failover), for its worker to send again what was lost; then it ends with an error"
        },
    )
    max_body_bytes: int = field(default=4 << 20, metadata={"help": "largest request body accepted"})
    retry_after: int = field(default=2, metadata={"help": "seconds in Retry-After when the queue is full"})
    keepalive_seconds: float = field(
        default=5.0, metadata={"help": "idle seconds between keep-alives on a stream (Anthropic `ping`)"}
    )
    default_max_tokens: int = field(default=512, metadata={"help": "max_tokens when a request gives none"})
    sampling_defaults: str = field(
        default="temperature=0.8,top_p=0.95,top_k=40,min_p=0.05",
        metadata={
            "help": "the distribution of a request that sets none of temperature/top_p/top_k/min_p (empty = the API's own: temperature 1, nothing cut)"
        },
    )
    admission_wait: float = field(
        default=10.0,
        metadata={"help": "seconds a streaming request waits for a worker to admit it before its headers are sent"},
    )
    allowed_origins: str = field(
        default="",
        metadata={"help": "comma-separated origins whose pages may call the API (CORS), `*` for any; empty = none"},
    )
    allowed_hosts: str = field(
        default="",
        metadata={
            "help": "comma-separated Host names the gateway answers, `*` for any; empty = the localhost names and the listen address when listening on loopback, any otherwise"
        },
    )
    write_timeout: float = field(
        default=10.0,
        metadata={"help": "seconds a write may wait for a client that stopped reading before its stream is cut"},
    )
    thinking_secret: str = field(
        default="",
        metadata={
            "help": "signs Anthropic thinking blocks (HMAC-SHA256) so they verify when clients send them back; the same on every gateway; empty = a random one per gateway process"
        },
    )
    rate_limit_requests: int = field(
        default=0,
        metadata={
            "help": "requests a minute each API key may make (a key file line may set its own: `KEY requests=N`); 0 = no limit"
        },
    )
    rate_limit_tokens: int = field(
        default=0,
        metadata={"help": "prompt + completion tokens a minute each API key may use (`KEY tokens=N`); 0 = no limit"},
    )
    batch_max_items: int = field(
        default=50_000, metadata={"help": "most requests in one batch (OpenAI input file line, Anthropic request)"}
    )
    batch_max_bytes: int = field(
        default=64 << 20, metadata={"help": "largest batch input: an uploaded file, or an Anthropic batch's body"}
    )
    batch_in_flight: int = field(
        default=256,
        metadata={
            "help": "items of one batch in the request streams at once; keep it above the workers' --max-seqs together"
        },
    )
    batch_window_seconds: float = field(
        default=86_400.0, metadata={"help": "seconds a batch may take before its unfinished items expire (`24h`)"}
    )
    response_ttl: float = field(
        default=86_400.0,
        metadata={"help": "seconds a stored Responses API response (`store`, the default) is kept after it ends"},
    )
    gateway_id: str = field(
        default_factory=lambda: uuid.uuid4().hex[:12],
        metadata={"help": "unique id; names this gateway's reply channel"},
    )
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})
    log_format: str = field(default="text", metadata={"help": "text, or json: one JSON object a line"})
    otlp_endpoint: str = field(
        default="",
        metadata={"help": "OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces); empty = tracing off"},
    )

    @functools.cached_property
    def sampling_default_fields(self) -> dict[str, Any]:
        return parse_sampling_defaults(self.sampling_defaults)


def parse_sampling_defaults(text: str) -> dict[str, Any]:
    """`temperature=0.8,top_k=40` → {"temperature": 0.8, "top_k": 40}, checked as the protocol checks them."""
    fields: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in protocol.DISTRIBUTION_FIELDS:
            raise ValueError(f"sampling defaults: {name!r} is not one of {', '.join(protocol.DISTRIBUTION_FIELDS)}")
        try:
            fields[name] = int(value) if name == "top_k" else float(value)
        except ValueError:
            raise ValueError(f"sampling defaults: {item!r} needs a number") from None
    try:
        protocol.parse_sampling(fields)
    except protocol.ProtocolError as exc:
        raise ValueError(f"sampling defaults: {exc.message}") from None
    return fields
