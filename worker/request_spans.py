"""The OpenTelemetry spans of one request on a worker, continuing the producer's trace.

    lmq.worker.request           admission → its last write acknowledged by Redis
      ├─ queue_wait              enqueued (the stream entry's time) → admission
      ├─ prefill                 admission → first token streamed
      ├─ decode                  first token → last token
      └─ publish                 last token → its write acknowledged

Times are taken where the worker already observes them (the request table's callbacks), so a
step costs nothing more than a few calls when tracing is off (protocol/tracing.py).
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from protocol import Request
from protocol.tracing import parent_context, tracer


def _entry_time_ns(entry_id: str) -> int | None:
    """A stream entry id starts with its creation time in milliseconds."""
    millis = entry_id.partition("-")[0]
    return int(millis) * 1_000_000 if millis.isdigit() else None


class RequestSpans:
    def __init__(self, request: Request, entry_id: str, worker_id: str, resumed_tokens: int):
        attributes = {
            "lmq.request_id": request.id,
            "lmq.model": request.model,
            "lmq.worker": worker_id,
            "lmq.resumed_tokens": resumed_tokens,
        }
        self.root = tracer.start_span(
            "lmq.worker.request", context=parent_context(request.trace), attributes=attributes
        )
        self._context = trace.set_span_in_context(self.root)
        enqueued = _entry_time_ns(entry_id)
        if enqueued is not None and enqueued < time.time_ns():
            tracer.start_span("queue_wait", context=self._context, start_time=enqueued).end()
        self._phase = tracer.start_span("prefill", context=self._context)
        self._in_decode = False

    def tokens_streamed(self) -> None:
        """A delta went out: the first one ends prefill."""
        if not self._in_decode:
            self._phase.end()
            self._phase = tracer.start_span("decode", context=self._context)
            self._in_decode = True

    def ended(self, outcome: str) -> None:
        """The last event is queued for writing."""
        self.root.set_attribute("lmq.outcome", outcome)
        self._phase.end()
        self._phase = tracer.start_span("publish", context=self._context)

    def written(self) -> None:
        self._phase.end()
        self.root.end()

    def dropped(self, reason: str) -> None:
        self.root.set_status(Status(StatusCode.ERROR, reason))
        self._phase.end()
        self.root.end()
