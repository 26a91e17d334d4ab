"""Prometheus metrics of one gateway process (its own registry, so tests can run many gateways).

docs/deploy.md ("Watching it") lists every metric. Conventions: counters end in `_total`, durations
are histograms in seconds, and a `model` label only ever holds a name a live worker serves (never
one a client made up). Errors are counted by their code, from one vocabulary (`ApiError.label`).
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from redis.exceptions import RedisError

from .errors import ApiError

# No `<name>_created` series next to each counter and histogram (for the whole process): a
# second series per series that Prometheus's text format does not need.
disable_created_metrics()

# Time to the first token: the prefill of a short prompt on an idle GPU (tens of ms) up to a long
# prompt behind a full queue (minutes).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 320, 640)
# Time per output token: a few ms on a GPU to seconds on a loaded CPU.
TPOT_BUCKETS = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10)
# A whole request: well under a second (a few tokens) to the request timeout (600 s by default).
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1200, 2400)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        registry = self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "lmq_http_requests",
            "HTTP requests answered, by route and HTTP status",
            ["route", "status"],
            registry=registry,
        )
        self.requests = Counter(
            "lmq_requests",
            "generation requests handed to the queue, by how they ended: a finish reason (stop, length), "
            "an error code, or client_closed",
            ["model", "api", "outcome"],
            registry=registry,
        )
        self.errors = Counter(
            "lmq_errors",
            "errors answered (also those sent inside a stream), by error code",
            ["code"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "lmq_prompt_tokens", "prompt tokens of the requests that finished", ["model"], registry=registry
        )
        self.generation_tokens = Counter(
            "lmq_generation_tokens", "generated tokens relayed to clients", ["model"], registry=registry
        )
        self.time_to_first_token = Histogram(
            "lmq_time_to_first_token_seconds",
            "from enqueueing a request to its first token",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            "lmq_time_per_output_token_seconds",
            "mean time between the tokens of a finished request, after the first",
            ["model"],
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.e2e_request_latency = Histogram(
            "lmq_e2e_request_latency_seconds",
            "from enqueueing a request to its last token (requests that finished)",
            ["model"],
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "lmq_queue_wait_seconds",
            "from enqueueing a request to the first event a worker sent for it (its first token, or an error)",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.vllm_prompt_tokens = Counter(
            "vllm:prompt_tokens", "alias of lmq_prompt_tokens_total", ["model_name"], registry=registry
        )
        # vLLM's names for the same observations (label model_name), for recipes written for vLLM.
        # inter_token_latency is lmq's per-request mean; request_queue_time includes the prefill.
        self.vllm_aliases = {
            histogram: Histogram(
                name, "the same observations as the lmq_ histogram", ["model_name"], buckets=buckets, registry=registry
            )
            for histogram, name, buckets in (
                (self.time_to_first_token, "vllm:time_to_first_token_seconds", TTFT_BUCKETS),
                (self.time_per_output_token, "vllm:inter_token_latency_seconds", TPOT_BUCKETS),
                (self.e2e_request_latency, "vllm:e2e_request_latency_seconds", E2E_BUCKETS),
                (self.queue_wait, "vllm:request_queue_time_seconds", TTFT_BUCKETS),
            )
        }
        self.queue_depth = Gauge(
            "lmq_queue_depth",
            "requests in the model's stream not yet read by a worker (read at scrape time)",
            ["model"],
            registry=registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def request(self, model: str, api: str, timed: bool = True) -> RequestMetrics:
        return RequestMetrics(self, model, api, timed)


class RequestMetrics:
    """What one generation request adds to the metrics; `Generation` calls it as its events come.

    Times start when the request is created, just before it is enqueued. `timed=False` keeps the
    request out of the latency histograms (count_tokens: one token no client waits on as an answer).
    """

    def __init__(self, metrics: Metrics, model: str, api: str, timed: bool):
        self._metrics = metrics
        self.model = model
        self.api = api
        self.timed = timed
        self._created_at = time.monotonic()
        self._first_event_at: float | None = None
        self._first_token_at: float | None = None
        self.outcome: str | None = None

    def event(self) -> None:
        """An event of any kind came from a worker."""
        if self._first_event_at is None:
            self._first_event_at = time.monotonic()
            self._observe(self._metrics.queue_wait, self._first_event_at - self._created_at)

    def tokens(self, count: int) -> None:
        """`count` new tokens were relayed."""
        self._metrics.generation_tokens.labels(self.model).inc(count)
        if self._first_token_at is None and count:
            self._first_token_at = time.monotonic()
            self._observe(self._metrics.time_to_first_token, self._first_token_at - self._created_at)

    def done(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        now = time.monotonic()
        if self._first_token_at is not None and completion_tokens > 1:
            self._observe(self._metrics.time_per_output_token, (now - self._first_token_at) / (completion_tokens - 1))
        self._observe(self._metrics.e2e_request_latency, now - self._created_at)
        self._metrics.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self._metrics.vllm_prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.ended(finish_reason)

    def ended(self, outcome: str) -> None:
        """Count the request by how it ended: a finish reason, an error code, or client_closed; once."""
        if self.outcome is None:
            self.outcome = outcome
            self._metrics.requests.labels(self.model, self.api, outcome).inc()

    def left(self, exc: BaseException | None) -> None:
        """The request's block was left, perhaps early, perhaps by `exc` (counted unless already)."""
        self.ended(outcome_of(exc))

    def _observe(self, histogram: Histogram, seconds: float) -> None:
        if self.timed:
            histogram.labels(self.model).observe(seconds)
            self._metrics.vllm_aliases[histogram].labels(self.model).observe(seconds)


def outcome_of(exc: BaseException | None) -> str:
    """How a request that ended without its `done` ended."""
    if isinstance(exc, ApiError):
        return exc.label
    if isinstance(exc, RedisError):
        return "unavailable"  # as the error middleware answers it
    if exc is None or isinstance(exc, (asyncio.CancelledError, ConnectionResetError)):
        return "client_closed"  # aiohttp cancelled the handler, or a write found the client gone
    return "internal"


def metrics_middleware(metrics: Metrics) -> Middleware:
    @web.middleware
    async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        metrics.http_requests.labels(route, str(response.status)).inc()
        return response

    return count_requests
