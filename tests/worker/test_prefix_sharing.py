"""Prompts that arrive together and share their beginning are prefilled once: the `n` choices of a
request, or a burst of requests with one system prompt (scheduler.py, `_reading_its_prefix`)."""

from __future__ import annotations

from tests.support.engine_runs import generate, greedy
from worker.engine import GenRequest


async def test_identical_prompts_arriving_together_are_prefilled_once(tiny) -> None:
    prompt = list(range(5, 5 + 70))  # 4 full pages of 16 and a partial one
    requests = [GenRequest(f"choice-{i}", prompt, greedy(4)) for i in range(3)]
    results = await generate(tiny, requests, page_size=16)
    full_pages = (len(prompt) - 1) // 16 * 16
    assert [results[f"choice-{i}"].cached_tokens for i in range(3)] == [0, full_pages, full_pages]
    assert len({tuple(result.token_ids) for result in results.values()}) == 1  # a hit changes nothing


async def test_different_prompts_do_not_wait_for_each_other(tiny) -> None:
    requests = [GenRequest(f"r{i}", [7 + i] * 40, greedy(4)) for i in range(3)]
    engines = []
    results = await generate(tiny, requests, page_size=16, engine_out=engines)
    assert all(result.cached_tokens == 0 for result in results.values())
    assert engines[0].stats.steps == 4  # admitted together: one prefill step, then three decodes
