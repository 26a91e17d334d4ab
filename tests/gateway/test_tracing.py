"""One trace across processes: the gateway's span travels in the protocol's `trace` field and the
worker's spans (queue wait, prefill, decode, publish) continue it. Spans are collected in memory
here; in production they go to an OTLP endpoint (protocol/tracing.py)."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protocol.tracing import parent_context, traceparent
from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the global provider can be set once per process
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


async def _finished(spans: InMemorySpanExporter, name: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [span for span in spans.get_finished_spans() if span.name == name]
        if found:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"no finished span {name}: {[s.name for s in spans.get_finished_spans()]}")


async def test_a_request_is_one_trace_from_gateway_to_worker(tiny, redis_url, spans):
    spans.clear()
    async with real_worker(redis_url, tiny), running_gateway(redis_url) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        await client.chat.completions.create(
            model=REAL_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
        )
        await client.close()
        [worker_root] = await _finished(spans, "lmq.worker.request")
    [gateway_root] = [span for span in spans.get_finished_spans() if span.name == "lmq.gateway.request"]
    assert worker_root.context.trace_id == gateway_root.context.trace_id
    assert worker_root.parent.span_id == gateway_root.context.span_id
    children = {
        span.name: span
        for span in spans.get_finished_spans()
        if span.parent and span.parent.span_id == worker_root.context.span_id
    }
    assert set(children) == {"queue_wait", "prefill", "decode", "publish"}
    assert (
        children["queue_wait"].end_time
        <= children["prefill"].start_time
        <= children["decode"].start_time
        <= children["publish"].start_time
    )
    assert worker_root.attributes["lmq.outcome"] == "length"
    assert gateway_root.attributes["lmq.completion_tokens"] == 5


def test_without_a_provider_nothing_travels():
    """Tracing off: a span that records nothing gives no traceparent, so the protocol field stays out."""
    span = trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)
    assert traceparent(span) is None and parent_context(None) is None
