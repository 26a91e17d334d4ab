"""Every /metrics endpoint passes `promtool check metrics` (Prometheus's own linter) after real traffic,
and exports the names and labels docs/deploy.md ("Watching it") lists.

promtool comes with Prometheus: `apt-get install -y --no-install-recommends prometheus` on Debian and
Ubuntu. Without it the lint is skipped; the names and labels are checked all the same.
"""

from __future__ import annotations

import shutil
import subprocess

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

import protocol
from lmq.redis_server import free_tcp_port
from tests.support.gateway_harness import MODEL, REAL_MODEL, real_worker, running_gateway, worker_running
from tests.support.worker_harness import wait_for

PROMTOOL_INSTALL = "apt-get install -y --no-install-recommends prometheus"
MAX_TOKENS = 4
MESSAGES = [{"role": "user", "content": "Say something"}]

# name -> the labels of its samples (a histogram's buckets add `le`)
GATEWAY_METRICS = {
    "lmq_http_requests_total": {"route", "status"},
    "lmq_requests_total": {"model", "api", "outcome"},
    "lmq_errors_total": {"code"},
    "lmq_prompt_tokens_total": {"model"},
    "lmq_generation_tokens_total": {"model"},
    "lmq_time_to_first_token_seconds": {"model"},
    "lmq_time_per_output_token_seconds": {"model"},
    "lmq_e2e_request_latency_seconds": {"model"},
    "lmq_queue_wait_seconds": {"model"},
    "lmq_queue_depth": {"model"},
}
WORKER_METRICS = {
    "lmq_requests_running": {"model"},
    "lmq_requests_waiting": {"model"},
    "lmq_kv_pages_used": {"model"},
    "lmq_kv_pages": {"model"},
    "lmq_prefix_cache_lookup_tokens_total": {"model"},
    "lmq_prefix_cache_hit_tokens_total": {"model"},
    "lmq_generation_tokens_total": {"model"},
    "lmq_preemptions_total": {"model"},
    "lmq_requests_finished_total": {"model", "outcome"},
    "lmq_step_seconds": {"model"},
}
# vLLM's names for the engine's gauges and counters, with vLLM's label (issue 29)
WORKER_VLLM_ALIASES = {
    "vllm:num_requests_running": "lmq_requests_running",
    "vllm:num_requests_waiting": "lmq_requests_waiting",
    "vllm:generation_tokens_total": "lmq_generation_tokens_total",
    "vllm:num_preemptions_total": "lmq_preemptions_total",
}
GATEWAY_VLLM_ALIASES = {
    "vllm:prompt_tokens_total": "lmq_prompt_tokens_total",
    "vllm:time_to_first_token_seconds_count": "lmq_time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count": "lmq_time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count": "lmq_e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count": "lmq_queue_wait_seconds_count",
}
HISTOGRAMS = {
    "lmq_time_to_first_token_seconds",
    "lmq_time_per_output_token_seconds",
    "lmq_e2e_request_latency_seconds",
    "lmq_queue_wait_seconds",
    "lmq_step_seconds",
}


def promtool_problems(text: str) -> str | None:
    """What `promtool check metrics` says about `text` (empty when it passes cleanly); None without promtool."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return None
    result = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    # promtool's lint reserves ':' for recording rules; vLLM's names have it, and the aliases exist
    # to be those names exactly: that one warning, on those names only, is expected.
    lines = [
        line
        for line in (result.stdout + result.stderr).decode().strip().splitlines()
        if not (line.startswith("vllm:") and line.endswith("metric names should not contain ':'"))
    ]
    return "\n".join(lines)


def samples_by_name(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name (histograms: the family's name) -> the label sets of its samples."""
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = family.name if family.type == "histogram" else sample.name
            samples.setdefault(name, []).append(sample.labels)
    return samples


def value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def traffic(http: aiohttp.ClientSession, url: str) -> None:
    """One request of every kind, and some errors."""
    openai_body = {"model": REAL_MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    anthropic_headers = {"anthropic-version": "2023-06-01"}
    anthropic_body = {"model": REAL_MODEL, "max_tokens": MAX_TOKENS, "messages": MESSAGES}
    async with http.post(url + "/v1/chat/completions", json=openai_body | {"messages": MESSAGES}) as response:
        assert response.status == 200, await response.text()
    async with http.post(
        url + "/v1/chat/completions", json=openai_body | {"messages": MESSAGES, "stream": True}
    ) as response:
        assert b"[DONE]" in await response.read()
    async with http.post(url + "/v1/completions", json=openai_body | {"prompt": "Once upon a time"}) as response:
        assert response.status == 200, await response.text()
    async with http.post(
        url + "/v1/messages", json=anthropic_body | {"stream": True}, headers=anthropic_headers
    ) as response:
        assert b"message_stop" in await response.read()
    async with http.post(
        url + "/v1/messages/count_tokens", json={"model": REAL_MODEL, "messages": MESSAGES}, headers=anthropic_headers
    ) as response:
        assert response.status == 200, await response.text()
    # errors: an unknown model, a body that is not JSON, a path that does not exist
    async with http.post(
        url + "/v1/chat/completions", json={"model": "no-such-model", "messages": MESSAGES}
    ) as response:
        assert response.status == 404
    async with http.post(
        url + "/v1/chat/completions", data=b"{", headers={"Content-Type": "application/json"}
    ) as response:
        assert response.status == 400
    async with http.get(url + "/v1/nothing-here") as response:
        assert response.status == 404


async def test_every_metrics_endpoint_passes_promtool_with_the_documented_names(redis_url, tiny):
    port = free_tcp_port()
    async with real_worker(redis_url, tiny, metrics_port=port), running_gateway(redis_url) as url:
        async with aiohttp.ClientSession() as http:
            await traffic(http, url)
            async with http.get(url + "/metrics") as response:
                assert response.status == 200
                gateway_text = await response.text()
            async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                assert response.status == 200
                worker_text = await response.text()

    for endpoint, text, expected in (
        ("gateway", gateway_text, GATEWAY_METRICS),
        ("worker", worker_text, WORKER_METRICS),
    ):
        samples = samples_by_name(text)
        for name, labels in expected.items():
            assert name in samples, f"the {endpoint} exports no {name}:\n{text}"
            for sample_labels in samples[name]:
                want = labels | {"le"} if name in HISTOGRAMS and "le" in sample_labels else labels
                assert set(sample_labels) == want, (endpoint, name, sample_labels)
            if "model" in labels:
                assert {sample["model"] for sample in samples[name]} == {REAL_MODEL}, (endpoint, name)
        lmq_names = {name for name in samples if name.startswith("lmq_")}
        assert lmq_names == set(expected), f"the {endpoint} exports undocumented metrics: {lmq_names - set(expected)}"

    # vLLM's names carry the same values under `model_name`
    for alias, name in WORKER_VLLM_ALIASES.items():
        assert value(worker_text, alias, model_name=REAL_MODEL) == value(worker_text, name, model=REAL_MODEL), alias
    for alias, name in GATEWAY_VLLM_ALIASES.items():
        assert value(gateway_text, alias, model_name=REAL_MODEL) == value(gateway_text, name, model=REAL_MODEL) > 0, (
            alias
        )
    assert 0 <= value(worker_text, "vllm:kv_cache_usage_perc", model_name=REAL_MODEL) <= 1
    assert value(worker_text, "vllm:generation_tokens_total", model_name=REAL_MODEL) > 0

    # one vocabulary of error codes, never a bare HTTP status
    codes = {labels["code"] for labels in samples_by_name(gateway_text)["lmq_errors_total"]}
    assert {"model_not_found", "bad_request", "not_found"} <= codes
    assert not any(code.isdigit() for code in codes), codes

    # the requests, by endpoint; count_tokens stays out of the latency histograms
    for api in ("chat_completions", "completions", "messages", "count_tokens"):
        assert value(gateway_text, "lmq_requests_total", api=api) == (2 if api == "chat_completions" else 1), api
    assert value(gateway_text, "lmq_requests_total", api="chat_completions", outcome="length") == 2
    assert value(gateway_text, "lmq_e2e_request_latency_seconds_count", model=REAL_MODEL) == 4
    assert value(gateway_text, "lmq_time_to_first_token_seconds_count", model=REAL_MODEL) == 4
    assert value(gateway_text, "lmq_queue_wait_seconds_count", model=REAL_MODEL) == 4
    assert value(gateway_text, "lmq_prompt_tokens_total", model=REAL_MODEL) > 0
    # every token the worker sampled reached a client
    generated = value(worker_text, "lmq_generation_tokens_total", model=REAL_MODEL)
    assert generated == value(gateway_text, "lmq_generation_tokens_total", model=REAL_MODEL) > 3 * MAX_TOKENS
    assert value(worker_text, "lmq_requests_finished_total", model=REAL_MODEL) == 5
    assert value(worker_text, "lmq_step_seconds_count", model=REAL_MODEL) >= 3 * MAX_TOKENS

    problems = {
        endpoint: promtool_problems(text) for endpoint, text in (("gateway", gateway_text), ("worker", worker_text))
    }
    if None in problems.values():
        pytest.skip(f"promtool is not installed (Debian/Ubuntu: `{PROMTOOL_INSTALL}`); names and labels were checked")
    assert problems == {"gateway": "", "worker": ""}, problems


def ending_script(request: protocol.Request) -> list[list[dict]]:
    """A worker's answers by prompt: "fail" gets a prompt_too_long error, "hang" one delta and nothing more."""
    prompt = request.messages[-1]["content"]
    if prompt == "fail":
        return [[protocol.error_event(request.id, 0, "prompt_too_long", "the prompt does not fit")]]
    return [[protocol.delta_event(request.id, 0, "Hi", [100], 0)]]


async def test_a_request_is_counted_once_by_how_it_ended(redis_url, redis_client):
    """An error, in a stream or not, counts once as the request's outcome and once as an error; a client that
    leaves mid-stream is `client_closed` and no error."""
    body = {"model": MODEL, "max_tokens": MAX_TOKENS}
    async with (
        running_gateway(redis_url, pickup_timeout=60.0, keepalive_seconds=3600.0) as url,
        worker_running(redis_client, ending_script),
    ):
        async with aiohttp.ClientSession() as http:
            failing = body | {"messages": [{"role": "user", "content": "fail"}]}
            async with http.post(url + "/v1/chat/completions", json=failing) as response:
                assert response.status == 400
            async with http.post(url + "/v1/chat/completions", json=failing | {"stream": True}) as response:
                assert b"prompt_too_long" in await response.read()
            hanging = body | {"messages": [{"role": "user", "content": "hang"}], "stream": True}
            async with http.post(url + "/v1/chat/completions", json=hanging) as response:
                async for line in response.content:
                    if b"Hi" in line:
                        break  # the first token came: leave

            async def scraped() -> str | None:
                async with http.get(url + "/metrics") as response:
                    text = await response.text()
                return text if value(text, "lmq_requests_total", outcome="client_closed") else None

            text = await wait_for(scraped, what="the gateway to count the request its client left")

    assert value(text, "lmq_requests_total", model=MODEL, api="chat_completions", outcome="prompt_too_long") == 2
    assert value(text, "lmq_requests_total", model=MODEL, api="chat_completions", outcome="client_closed") == 1
    assert value(text, "lmq_requests_total") == 3
    assert value(text, "lmq_errors_total", code="prompt_too_long") == 2
    assert value(text, "lmq_errors_total") == 2
    assert value(text, "lmq_generation_tokens_total", model=MODEL) == 1
    assert value(text, "lmq_e2e_request_latency_seconds_count") == 0  # none finished
    assert value(text, "lmq_time_to_first_token_seconds_count", model=MODEL) == 1
    assert value(text, "lmq_queue_wait_seconds_count", model=MODEL) == 3
    assert promtool_problems(text) in ("", None)
