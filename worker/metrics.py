"""Worker metrics in Prometheus format, in a registry of the worker's own (several may share a process).

Every metric carries the `model` label (the name the worker serves) and docs/deploy.md ("Watching it")
lists them all. The engine's state is read at scrape time, so no loop has to copy it; step durations
and outcomes are recorded as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.engine import EngineStats

# No `<name>_created` series next to each counter and histogram (for the whole process): a
# second series per series that Prometheus's text format does not need.
disable_created_metrics()

# One engine step: a few ms (a decode step on a GPU) to seconds (a long prefill chunk on a CPU).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10)


class _EngineCollector(Collector):
    """Reads the engine's statistics at scrape time."""

    def __init__(self, model: str, stats: Callable[[], EngineStats]):
        self._model = model
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=["model"])
            family.add_metric([self._model], value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, documentation, labels=["model"])  # the name without _total
            family.add_metric([self._model], value)
            return family

        yield gauge("lmq_requests_running", "sequences in the running batch", stats.running)
        yield gauge(
            "lmq_requests_waiting", "requests handed to the engine and waiting for pages or a slot", stats.waiting
        )
        yield gauge("lmq_kv_pages_used", "KV cache pages held by sequences", stats.kv_pages_used)
        yield gauge("lmq_kv_pages", "KV cache pages in the pool (its capacity)", stats.kv_pages_total)
        yield counter(
            "lmq_prefix_cache_lookup_tokens", "prompt tokens looked up in the prefix cache", stats.prefix_lookup_tokens
        )
        yield counter(
            "lmq_prefix_cache_hit_tokens",
            "prompt tokens found in the prefix cache (not computed again)",
            stats.prefix_hit_tokens,
        )
        yield counter("lmq_generation_tokens", "tokens sampled", stats.tokens_generated)
        yield counter("lmq_preemptions", "sequences preempted for pages (their KV recomputed later)", stats.preemptions)
        yield from self._vllm_aliases(stats)

    def _vllm_aliases(self, stats: EngineStats) -> Iterator[Metric]:
        """vLLM's names and label (`model_name`) for the same values, so autoscaling and routing
        recipes written for vLLM (KEDA on waiting requests, the Gateway API inference extension's
        queue, running and KV gauges) read lmq unchanged."""

        def family(kind: type, name: str, documentation: str, value: float) -> Metric:
            metric = kind(name, documentation, labels=["model_name"])
            metric.add_metric([self._model], value)
            return metric

        usage = stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0
        yield family(GaugeMetricFamily, "vllm:num_requests_running", "alias of lmq_requests_running", stats.running)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "alias of lmq_requests_waiting", stats.waiting)
        yield family(
            GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV cache pages in use, a fraction (1 = full)", usage
        )
        yield family(
            CounterMetricFamily,
            "vllm:generation_tokens",
            "alias of lmq_generation_tokens_total",
            stats.tokens_generated,
        )
        yield family(CounterMetricFamily, "vllm:num_preemptions", "alias of lmq_preemptions_total", stats.preemptions)


class WorkerMetrics:
    def __init__(self, model: str, stats: Callable[[], EngineStats]):
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model, stats))
        self.finished = Counter(
            "lmq_requests_finished",
            "requests answered, by outcome: a finish reason (stop, length, cancelled) or an error code",
            ["model", "outcome"],
            registry=self.registry,
        )
        step_seconds = Histogram(
            "lmq_step_seconds",
            "duration of an engine step (model forward and sampling)",
            ["model"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self._step_seconds = step_seconds.labels(model)  # exported (empty) from the start
        self._server = None

    def count_finished(self, outcome: str) -> None:
        self.finished.labels(self.model, outcome).inc()

    def observe_step(self, seconds: float) -> None:
        self._step_seconds.observe(seconds)

    def serve(self, port: int) -> None:
        self._server, _ = start_http_server(port, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
