"""Worker metrics in Prometheus format, in a registry of the worker's own (several may share a process)."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.engine import EngineStats


class _EngineCollector(Collector):
    """Reads the engine's statistics at scrape time, so no loop has to copy them."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield GaugeMetricFamily("lmq_requests_running", "sequences in the running batch", value=stats.running)
        yield GaugeMetricFamily("lmq_requests_waiting", "sequences waiting for pages or a slot", value=stats.waiting)
        pages = GaugeMetricFamily("lmq_kv_pages", "KV cache pages by state", labels=["state"])
        pages.add_metric(["used"], stats.kv_pages_used)
        pages.add_metric(["free"], stats.kv_pages_free)
        yield pages
        yield GaugeMetricFamily("lmq_kv_pages_total", "KV cache pages in the pool", value=stats.kv_pages_total)
        yield CounterMetricFamily("lmq_prefix_hit_tokens", "prompt tokens served from the prefix cache", value=stats.prefix_hit_tokens)
        yield CounterMetricFamily("lmq_prefix_lookup_tokens", "prompt tokens looked up in the prefix cache", value=stats.prefix_lookup_tokens)
        hit_rate = stats.prefix_hit_tokens / stats.prefix_lookup_tokens if stats.prefix_lookup_tokens else 0.0
        yield GaugeMetricFamily("lmq_prefix_hit_rate", "share of looked-up prompt tokens found in the cache", value=hit_rate)
        yield CounterMetricFamily("lmq_tokens_generated", "tokens sampled", value=stats.tokens_generated)
        yield CounterMetricFamily("lmq_engine_steps", "engine steps run", value=stats.steps)
        yield GaugeMetricFamily("lmq_step_seconds", "duration of the last engine step", value=stats.last_step_seconds)


class WorkerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.finished = Counter("lmq_requests_finished", "requests answered, by finish reason or error code", ["outcome"], registry=self.registry)
        self._server = None

    def serve(self, port: int) -> None:
        self._server, _ = start_http_server(port, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
