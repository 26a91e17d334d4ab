"""Property test: random arrivals, lengths and cancellations on a tiny pool that forces preemption.

Afterwards every page is free, every request finished exactly once, and every request that was not
cancelled produced the same greedy tokens as in an unconstrained run.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.engine_runs import generate, greedy
from tests.support.tiny_model import VOCAB
from worker.engine import Engine, GenRequest
from worker.kv_cache import page_bytes
from worker.model.loader import LoadedModel

PAGE = 4
SHARED_PREFIX = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]


@pytest.fixture(scope="module")
def model(tiny: LoadedModel) -> LoadedModel:
    return tiny


request_spec = st.fixed_dictionaries(
    {
        "tail": st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=24),
        "shared_prefix": st.booleans(),
        "max_tokens": st.integers(1, 14),
        "join": st.one_of(st.none(), st.integers(1, 10)),
        "cancel": st.one_of(st.none(), st.integers(1, 12)),
    }
)


def build(specs: list[dict]) -> tuple[list[GenRequest], dict[str, int], dict[str, int]]:
    requests, joins, cancels = [], {}, {}
    for index, spec in enumerate(specs):
        request_id = f"q{index}"
        ids = (SHARED_PREFIX if spec["shared_prefix"] else []) + spec["tail"]
        requests.append(GenRequest(request_id, ids, greedy(max_tokens=spec["max_tokens"])))
        if spec["join"] is not None:
            joins[request_id] = spec["join"]
        if spec["cancel"] is not None:
            cancels[request_id] = spec["cancel"]
    return requests, joins, cancels


@pytest.mark.timeout(900)  # 100 engine runs: 30 s idle, 60-80 s on busy cores; engine_runs' watchdog catches a hang
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=st.lists(request_spec, min_size=1, max_size=8),
    pages=st.integers(12, 20),  # the longest request (10 + 24 + 14 tokens) fits in 12 pages,
    max_seqs=st.integers(1, 5),
    step_tokens=st.integers(1, 24),
)
@pytest.mark.slow  # 50 random workloads: seconds
def test_random_workloads_free_every_page_and_finish_every_request_once(
    model: LoadedModel, specs: list[dict], pages: int, max_seqs: int, step_tokens: int
) -> None:
    requests, joins, cancels = build(specs)
    config = model.config
    budget = pages * page_bytes(config.num_layers, config.num_kv_heads, config.head_dim, PAGE, model.dtype)
    engines: list[Engine] = []
    results = asyncio.run(
        generate(
            model,
            requests,
            joins=joins,
            cancels=cancels,
            engine_out=engines,
            kv_memory_bytes=budget,
            page_size=PAGE,
            max_seqs=max_seqs,
            step_tokens=step_tokens,
        )
    )
    reference = asyncio.run(generate(model, requests, page_size=PAGE))
    stats = engines[0].stats
    assert stats.kv_pages_free == stats.kv_pages_total == pages
    assert stats.running == stats.waiting == 0
    for request in requests:
        result = results[request.id]
        assert result.finishes == 1
        assert result.cached_tokens <= result.prompt_tokens == len(request.prompt_ids)
        if result.finish_reason == "cancelled":
            assert request.id in cancels
            assert result.token_ids == reference[request.id].token_ids[: len(result.token_ids)]
        else:
            assert result.finish_reason == "length"
            assert result.token_ids == reference[request.id].token_ids
