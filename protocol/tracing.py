"""OpenTelemetry tracing, off unless an OTLP endpoint is configured.

A request's trace crosses processes through the protocol: the gateway puts its span's W3C
`traceparent` in the request's optional `trace` field, and the worker continues the trace from it
(queue wait, prefill, decode, publish). With no endpoint configured the OpenTelemetry API is a
no-op: spans cost a few function calls and are never exported.

Configure with `--otlp-endpoint` / `LMQ_OTLP_ENDPOINT` (an OTLP/HTTP traces URL such as
`http://collector:4318/v1/traces`); the standard `OTEL_*` variables (headers, service name
overrides) apply as the OpenTelemetry SDK reads them.
"""

from __future__ import annotations

import logging

from opentelemetry import context, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
tracer = trace.get_tracer("lmq")


def setup_tracing(service_name: str, endpoint: str) -> None:
    """Export spans over OTLP/HTTP to `endpoint`; an empty endpoint leaves tracing off."""
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    log.info("tracing: exporting spans of %s to %s", service_name, endpoint)


def traceparent(span: trace.Span) -> str | None:
    """The W3C traceparent of `span`, for the protocol's `trace` field (None when not recording)."""
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def parent_context(traceparent_value: str | None) -> context.Context | None:
    """The context a worker's spans continue from (None: a trace of their own)."""
    if not traceparent_value:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent_value})
