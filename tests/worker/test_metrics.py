"""The worker's Prometheus endpoint: engine gauges and counters read at scrape time, each with a `model` label."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from lmq.redis_server import free_tcp_port
from tests.support.worker_harness import MODEL, chat_request, enqueue, final_events, running_worker, worker_config

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # several full KV pages


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample: (name, its labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model": MODEL, **labels}.items()))]


async def test_metrics_describe_the_engine_and_the_outcomes(tiny, redis_url, redis_client):
    port = free_tcp_port()
    async with running_worker(worker_config(redis_url, "w1", metrics_port=port), tiny):
        await enqueue(redis_client, chat_request("r1", max_tokens=5, prompt=PROMPT))
        await final_events(redis_client, "out:r1")
        await enqueue(
            redis_client, chat_request("r2", max_tokens=5, prompt=PROMPT)
        )  # the same prompt: a prefix-cache hit
        await final_events(redis_client, "out:r2")
        samples = await asyncio.to_thread(_scrape, port)

    assert all(("model", MODEL) in labels or ("model_name", MODEL) in labels for _, labels in samples), (
        "every sample has the model label (vLLM's aliases: model_name)"
    )
    assert _value(samples, "lmq_generation_tokens_total") == 10
    assert _value(samples, "lmq_requests_finished_total", outcome="length") == 2
    assert _value(samples, "lmq_requests_running") == 0
    assert _value(samples, "lmq_requests_waiting") == 0
    assert _value(samples, "lmq_kv_pages_used") == 0
    assert _value(samples, "lmq_kv_pages") > 0
    assert _value(samples, "lmq_preemptions_total") == 0
    lookups = _value(samples, "lmq_prefix_cache_lookup_tokens_total")
    hits = _value(samples, "lmq_prefix_cache_hit_tokens_total")
    assert 0 < hits < lookups  # the second prompt found the first one's full pages
    steps = _value(samples, "lmq_step_seconds_count")
    assert steps >= 2 * 5 and _value(samples, "lmq_step_seconds_sum") > 0
    assert _value(samples, "lmq_step_seconds_bucket", le="+Inf") == steps
    names = {name for name, _ in samples}
    assert not names & {"lmq_kv_pages_total", "lmq_prefix_hit_rate", "lmq_tokens_generated_total"}, "old names are gone"
