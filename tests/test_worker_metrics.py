"""The worker's Prometheus endpoint: engine gauges and counters read at scrape time."""

from __future__ import annotations

import asyncio
import urllib.request

from worker_helpers import chat_request, enqueue, final_events, running_worker, worker_config

from lmq.redis_server import free_tcp_port




def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples}


async def test_metrics_describe_the_engine_and_the_outcomes(tiny, redis_url, redis_client):
    port = free_tcp_port()
    async with running_worker(worker_config(redis_url, "w1", metrics_port=port), tiny):
        await enqueue(redis_client, chat_request("r1", max_tokens=5))
        await enqueue(redis_client, chat_request("r2", max_tokens=5))  # same prompt: a prefix-cache hit
        await final_events(redis_client, "out:r1")
        await final_events(redis_client, "out:r2")
        metrics = await asyncio.to_thread(_scrape, port)
    assert metrics["lmq_tokens_generated_total"] == 10
    assert metrics['lmq_requests_finished_total{outcome="length"}'] == 2
    assert metrics["lmq_requests_running"] == 0
    assert metrics['lmq_kv_pages{state="used"}'] == 0
    assert metrics['lmq_kv_pages{state="free"}'] == metrics["lmq_kv_pages_total"] > 0
    assert metrics["lmq_engine_steps_total"] > 0
    assert metrics["lmq_step_seconds"] > 0
    assert 0 <= metrics["lmq_prefix_hit_rate"] <= 1
