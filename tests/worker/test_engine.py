"""The engine on a tiny float32 model: batching, chunking, prefix reuse, preemption, stops, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from protocol import SamplingParams
from tests.support.engine_runs import generate, greedy
from worker.engine import Engine, GenRequest, PromptTooLong, SeqOutput, TokenLogprob
from worker.kv_cache import page_bytes
from worker.model.loader import LoadedModel

PAGE = 4


@pytest.fixture(scope="module")
def model(tiny: LoadedModel) -> LoadedModel:
    return tiny


def prompt(model: LoadedModel, text: str) -> list[int]:
    return model.tokenizer.encode(text, add_special_tokens=False).ids


def pool_bytes(model: LoadedModel, pages: int) -> int:
    config = model.config
    return pages * page_bytes(config.num_layers, config.num_kv_heads, config.head_dim, PAGE, model.dtype)


TEXTS = [
    "The quick brown fox",
    "What is the capital of France? Paris is the capital.",
    "Hi",
    "A paged cache keeps keys and values; a batch mixes prefill chunks with decode steps.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42",
]


async def alone(model: LoadedModel, request: GenRequest, **options) -> list[int]:
    results = await generate(model, [request], page_size=PAGE, **options)
    return results[request.id].token_ids


async def test_greedy_output_is_the_same_alone_and_in_a_batch(model: LoadedModel) -> None:
    requests = [GenRequest(f"r{i}", prompt(model, text), greedy(max_tokens=10 + 3 * i)) for i, text in enumerate(TEXTS)]
    expected = {r.id: await alone(model, r) for r in requests}
    batched = await generate(model, requests, joins={"r3": 2, "r4": 5}, page_size=PAGE)
    assert {rid: result.token_ids for rid, result in batched.items()} == expected
    assert all(result.finish_reason == "length" and result.finishes == 1 for result in batched.values())


async def test_chunked_prefill_gives_the_same_output(model: LoadedModel) -> None:
    long_prompt = prompt(model, " ".join(TEXTS))
    request = GenRequest("long", long_prompt, greedy(max_tokens=16))
    whole = await alone(model, request, step_tokens=512)
    other = GenRequest("other", prompt(model, TEXTS[0]), greedy(max_tokens=30))
    chunked = await generate(model, [other, request], step_tokens=7, page_size=PAGE)
    assert chunked["long"].token_ids == whole
    assert chunked["other"].token_ids == await alone(model, other)


async def test_prefix_cache_hit_gives_the_same_output(model: LoadedModel) -> None:
    ids = prompt(model, TEXTS[3])
    cold = GenRequest("cold", ids, greedy(max_tokens=12))
    warm = GenRequest("warm", ids, greedy(max_tokens=12))
    results = await generate(model, [cold, warm], joins={"warm": "cold"}, page_size=PAGE)
    assert results["cold"].cached_tokens == 0
    assert results["warm"].cached_tokens == (len(ids) - 1) // PAGE * PAGE > 0
    assert results["warm"].token_ids == results["cold"].token_ids


async def test_next_chat_turn_reuses_the_generated_answer(model: LoadedModel) -> None:
    first_prompt = prompt(model, TEXTS[1])
    first = await generate(model, [GenRequest("t1", first_prompt, greedy(max_tokens=20))], page_size=PAGE)
    answer = first["t1"].token_ids
    second_prompt = first_prompt + answer + prompt(model, " And Spain?")
    turns = [
        GenRequest("t1", first_prompt, greedy(max_tokens=20)),
        GenRequest("t2", second_prompt, greedy(max_tokens=8)),
    ]
    results = await generate(model, turns, joins={"t2": "t1"}, page_size=PAGE)
    # Every full page of the first turn is reused, answer included (its last token's K/V is not computed).
    reusable = (len(first_prompt) + len(answer) - 1) // PAGE * PAGE
    assert results["t2"].cached_tokens == reusable > len(first_prompt)
    assert results["t2"].token_ids == await alone(model, turns[1])


async def test_sharing_only_a_middle_page_never_matches(model: LoadedModel) -> None:
    shared = prompt(model, "keys and values")[:PAGE]
    first = prompt(model, "The fox")[:PAGE] + shared + [5, 6, 7]
    second = prompt(model, "Hello")[:PAGE] + shared + [5, 6, 7]
    assert first[:PAGE] != second[:PAGE]
    requests = [GenRequest("a", first, greedy()), GenRequest("b", second, greedy())]
    results = await generate(model, requests, joins={"b": "a"}, page_size=PAGE)
    assert results["b"].cached_tokens == 0


async def test_preempted_sequences_finish_with_unchanged_output(model: LoadedModel) -> None:
    requests = [GenRequest(f"p{i}", prompt(model, text)[:12], greedy(max_tokens=20)) for i, text in enumerate(TEXTS)]
    expected = {r.id: await alone(model, r) for r in requests}
    engines: list[Engine] = []
    results = await generate(model, requests, kv_memory_bytes=pool_bytes(model, 12), page_size=PAGE, engine_out=engines)
    assert {rid: result.token_ids for rid, result in results.items()} == expected
    stats = engines[0].stats
    assert stats.preemptions > 0
    assert stats.kv_pages_free == stats.kv_pages_total == 12


async def test_seeded_sampling_is_the_same_alone_and_in_a_batch(model: LoadedModel) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.3, top_p=0.9, seed=7, ignore_eos=True)
    seeded = GenRequest("seeded", prompt(model, TEXTS[0]), params)
    expected = await alone(model, seeded)
    others = [
        GenRequest(f"o{i}", prompt(model, text), SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))
        for i, text in enumerate(TEXTS[1:])
    ]
    results = await generate(model, [*others, seeded], joins={"o2": 3}, page_size=PAGE)
    assert results["seeded"].token_ids == expected
    other_seed = GenRequest("seeded", prompt(model, TEXTS[0]), SamplingParams(**{**params.__dict__, "seed": 8}))
    assert await alone(model, other_seed) != expected


async def test_stop_string_trims_the_text_and_stops(model: LoadedModel) -> None:
    ids = prompt(model, TEXTS[0])
    full = (await generate(model, [GenRequest("full", ids, greedy(max_tokens=24))], page_size=PAGE))["full"]
    assert len(full.text) > 6
    stop = full.text[3:6]
    results = await generate(model, [GenRequest("s", ids, greedy(max_tokens=24, stop=[stop]))], page_size=PAGE)
    result = results["s"]
    assert result.finish_reason == "stop" and result.stop_sequence == stop
    assert result.text == full.text[: full.text.index(stop)]
    assert result.token_ids == full.token_ids[: len(result.token_ids)]


async def test_stop_token_ids_and_eos(model: LoadedModel) -> None:
    ids = prompt(model, TEXTS[1])
    full = (await generate(model, [GenRequest("full", ids, greedy(max_tokens=12))], page_size=PAGE))["full"]
    stop_token = full.token_ids[4]
    first = full.token_ids.index(stop_token)
    results = await generate(
        model, [GenRequest("s", ids, greedy(max_tokens=12, stop_token_ids=[stop_token]))], page_size=PAGE
    )
    assert results["s"].finish_reason == "stop" and results["s"].stop_sequence is None
    assert results["s"].token_ids == full.token_ids[: first + 1]
    assert results["s"].completion_tokens == first + 1


async def test_max_tokens_finishes_with_length(model: LoadedModel) -> None:
    results = await generate(model, [GenRequest("m", prompt(model, TEXTS[2]), greedy(max_tokens=3))], page_size=PAGE)
    result = results["m"]
    assert result.finish_reason == "length" and len(result.token_ids) == result.completion_tokens == 3
    assert result.prompt_tokens == len(prompt(model, TEXTS[2]))


async def test_resumed_request_continues_after_its_generated_tokens(model: LoadedModel) -> None:
    ids = prompt(model, TEXTS[3])
    full = (await generate(model, [GenRequest("full", ids, greedy(max_tokens=12))], page_size=PAGE))["full"]
    resumed = GenRequest("resumed", ids, greedy(max_tokens=12), generated_ids=full.token_ids[:5])
    result = (await generate(model, [resumed], page_size=PAGE))["resumed"]
    assert result.token_ids == full.token_ids[5:]
    assert result.completion_tokens == 12 and result.finish_reason == "length"
    assert full.text.endswith(result.text) and result.text


async def test_cancel_finishes_the_request_and_frees_its_pages(model: LoadedModel) -> None:
    requests = [GenRequest(f"c{i}", prompt(model, text), greedy(max_tokens=40)) for i, text in enumerate(TEXTS[:3])]
    engines: list[Engine] = []
    results = await generate(model, requests, cancels={"c1": 3}, page_size=PAGE, engine_out=engines)
    assert results["c1"].finish_reason == "cancelled" and results["c1"].finishes == 1
    assert len(results["c1"].token_ids) < 40
    assert results["c0"].finish_reason == results["c2"].finish_reason == "length"
    stats = engines[0].stats
    assert stats.kv_pages_free == stats.kv_pages_total and stats.running == stats.waiting == 0


async def test_prompt_that_can_never_fit_is_refused(model: LoadedModel) -> None:
    engine = Engine(model, on_step=lambda outputs: None, page_size=PAGE, kv_memory_bytes=pool_bytes(model, 8))
    too_long_for_context = GenRequest("ctx", [5] * model.config.max_context, greedy())
    with pytest.raises(PromptTooLong, match="256"):
        engine.add(too_long_for_context)
    too_big_for_pool = GenRequest("pool", [5] * 30, greedy(max_tokens=10))
    with pytest.raises(PromptTooLong, match="8 pages"):
        engine.add(too_big_for_pool)
    engine.add(GenRequest("fits", [5] * 30, greedy(max_tokens=2)))
    assert engine.free_slots() == engine.scheduler.max_seqs - 1


async def test_run_sleeps_until_work_arrives(model: LoadedModel) -> None:
    finished: list[str] = []
    engine = Engine(
        model, on_step=lambda outputs: finished.extend(o.id for o in outputs if o.finish_reason), page_size=PAGE
    )
    task = asyncio.create_task(engine.run())
    await asyncio.sleep(0.05)
    assert engine.stats.steps == 0 and not task.done()
    engine.add(GenRequest("late", prompt(model, TEXTS[0]), greedy(max_tokens=2)))
    engine.stop()
    await asyncio.wait_for(task, 30)
    assert finished == ["late"]


async def outputs_of(model: LoadedModel, requests: list[GenRequest]) -> dict[str, list[SeqOutput]]:
    """Every SeqOutput of each request, in order (engine_runs' Result keeps only their sum)."""
    outputs: dict[str, list[SeqOutput]] = {request.id: [] for request in requests}
    engine = Engine(model, on_step=lambda step: [outputs[o.id].append(o) for o in step], page_size=PAGE)
    for request in requests:
        engine.add(request)
    engine.stop()
    await asyncio.wait_for(engine.run(), 300)
    return outputs


def logprobs_of(outputs: list[SeqOutput]) -> list[TokenLogprob]:
    reports = []
    for output in outputs:
        assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
        assert [report.token_id for report in output.logprobs] == output.token_ids
        reports += output.logprobs
    return reports


async def test_logprobs_come_with_each_token_for_requests_that_ask(model: LoadedModel) -> None:
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, top_p=1.0, min_p=0.0, seed=5, ignore_eos=True)
    requests = [
        GenRequest("greedy", prompt(model, TEXTS[0]), greedy(max_tokens=12), logprobs=5),
        GenRequest("sampled", prompt(model, TEXTS[1]), sampled, logprobs=2),
        GenRequest("none", prompt(model, TEXTS[2]), greedy(max_tokens=12)),
        GenRequest("zero", prompt(model, TEXTS[3]), sampled, logprobs=0),
    ]
    outputs = await outputs_of(model, requests)
    assert all(output.logprobs is None for output in outputs["none"])
    for report in logprobs_of(outputs["greedy"]):
        assert report.top[0] == (report.token_id, report.logprob) and len(report.top) == 5
        assert [v for _, v in report.top] == sorted((v for _, v in report.top), reverse=True)
    for report in logprobs_of(outputs["sampled"]):
        assert report.logprob < 0.0 and len(report.top) == 2 and report.top[0][1] >= report.top[1][1]
        assert dict(report.top).get(report.token_id, report.logprob) == report.logprob
        assert report.token_id in dict(report.top) or report.logprob <= report.top[1][1]
    assert all(report.top == [] for report in logprobs_of(outputs["zero"]))
    assert len(logprobs_of(outputs["zero"])) == 12


async def test_logprobs_are_the_same_alone_and_in_a_batch(model: LoadedModel) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.2, top_p=0.9, seed=21, ignore_eos=True)
    request = GenRequest("lp", prompt(model, TEXTS[4]), params, logprobs=4)
    alone = logprobs_of((await outputs_of(model, [request]))["lp"])
    others = [
        GenRequest(f"o{i}", prompt(model, text), greedy(max_tokens=6 + i), logprobs=i)
        for i, text in enumerate(TEXTS[:3])
    ]
    batched = logprobs_of((await outputs_of(model, [*others, request]))["lp"])
    assert [r.token_id for r in batched] == [r.token_id for r in alone]
    for mine, theirs in zip(batched, alone):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert [v for _, v in mine.top] == pytest.approx([v for _, v in theirs.top], abs=1e-4)


async def test_a_resumed_request_reports_logprobs_of_its_new_tokens_only(model: LoadedModel) -> None:
    ids = prompt(model, TEXTS[3])
    whole = logprobs_of((await outputs_of(model, [GenRequest("w", ids, greedy(max_tokens=8), logprobs=1)]))["w"])
    resumed = GenRequest("r", ids, greedy(max_tokens=8), generated_ids=[r.token_id for r in whole[:3]], logprobs=1)
    rest = logprobs_of((await outputs_of(model, [resumed]))["r"])
    assert [r.token_id for r in rest] == [r.token_id for r in whole[3:]]
    assert [r.logprob for r in rest] == pytest.approx([r.logprob for r in whole[3:]], abs=1e-4)
