"""Prometheus metrics of one gateway process (its own registry, so tests can run many gateways)."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("lmq_gateway_requests", "HTTP requests answered", ["endpoint", "status"], registry=self.registry)
        self.errors = Counter("lmq_gateway_errors", "errors answered (also those sent inside a stream), by code", ["code"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "lmq_gateway_time_to_first_token_seconds", "from enqueue to the first token", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.time_per_output_token = Histogram(
            "lmq_gateway_time_per_output_token_seconds", "between tokens after the first", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.queue_depth = Gauge("lmq_gateway_queue_depth", "requests waiting for a worker, per model", ["model"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metrics_middleware(metrics: Metrics) -> Middleware:
    @web.middleware
    async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        metrics.requests.labels(endpoint, str(response.status)).inc()
        return response

    return count_requests
