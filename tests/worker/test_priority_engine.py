"""The engine with both priorities: preempting batch sequences for interactive ones never changes
an answer (float32 greedy, the tiny model), every request finishes once, and every page comes back."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.engine_runs import generate, greedy
from tests.support.tiny_model import VOCAB
from worker.engine import GenRequest
from worker.kv_cache import page_bytes
from worker.model.loader import LoadedModel

PAGE = 4

request_spec = st.fixed_dictionaries(
    {
        "tail": st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=16),
        "batch": st.booleans(),
        "max_tokens": st.integers(1, 10),
        "join": st.one_of(st.none(), st.integers(1, 8)),
    }
)


@pytest.mark.timeout(900)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=st.lists(request_spec, min_size=2, max_size=7),
    pages=st.integers(7, 12),
    max_seqs=st.integers(1, 4),
    step_tokens=st.integers(2, 16),
)
def test_mixed_priorities_give_the_unconstrained_answers(
    tiny: LoadedModel, specs: list[dict], pages: int, max_seqs: int, step_tokens: int
) -> None:
    requests = [
        GenRequest(
            f"q{i}",
            spec["tail"],
            greedy(max_tokens=spec["max_tokens"]),
            priority="batch" if spec["batch"] else "interactive",
        )
        for i, spec in enumerate(specs)
    ]
    joins = {f"q{i}": spec["join"] for i, spec in enumerate(specs) if spec["join"] is not None}
    config = tiny.config
    budget = pages * page_bytes(config.num_layers, config.num_kv_heads, config.head_dim, PAGE, tiny.dtype)
    engines = []
    results = asyncio.run(
        generate(
            tiny,
            requests,
            joins=joins,
            engine_out=engines,
            kv_memory_bytes=budget,
            page_size=PAGE,
            max_seqs=max_seqs,
            step_tokens=step_tokens,
        )
    )
    reference = asyncio.run(
        generate(tiny, [GenRequest(r.id, r.prompt_ids, r.sampling) for r in requests], page_size=PAGE)
    )
    stats = engines[0].stats
    assert stats.kv_pages_free == stats.kv_pages_total == pages
    for request in requests:
        assert results[request.id].finishes == 1
        assert results[request.id].token_ids == reference[request.id].token_ids
