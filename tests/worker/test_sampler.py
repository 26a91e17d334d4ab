"""The batched sampler: greedy is argmax, filters and penalties act per row, seeds are per request."""

from __future__ import annotations

import math

import pytest
import torch

from protocol import SamplingParams
from worker.sampler import SamplingState, greedy_tokens, sample

VOCAB = 50


def state(
    prompt: tuple[int, ...] = (), generated: tuple[int, ...] = (), logprobs: int | None = None, **params
) -> SamplingState:
    return SamplingState(
        SamplingParams(**params),
        prompt_ids=prompt,
        generated_ids=generated,
        vocab_size=VOCAB,
        device=torch.device("cpu"),
        logprobs=logprobs,
    )


def draw(logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    return sample(logits, states).tokens


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = random_logits(4)
    assert draw(logits.clone(), [state(temperature=0)] * 4) == logits.argmax(-1).tolist()


def test_greedy_tokens_are_torchs_argmax_ties_infinities_nans_and_views_included() -> None:
    generator = torch.Generator().manual_seed(1)
    special = torch.randn(5, VOCAB, generator=generator)
    special[0] = 0.0  # all tied: the first
    special[1] = float("-inf")
    special[2, [3, 9]] = float("nan")  # the first NaN, as torch
    special[3, [4, 8]] = float("inf")
    special[4, [7, 11]] = special[4].max() + 1  # a tie for the maximum
    cases = [
        special,
        torch.randint(0, 3, (64, 1000), generator=generator).float(),  # many ties
        torch.randn(16, 151_936 + 16, generator=generator)[:, :151_936],  # a strided view, a real vocabulary
    ]
    for logits in cases:
        with torch.inference_mode():
            tokens = greedy_tokens(logits)
        assert tokens.dtype == torch.int64 and torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_1_and_tiny_top_p_pick_the_argmax() -> None:
    logits = random_logits(3)
    states = [state(temperature=1.0, top_k=1), state(temperature=5.0, top_p=0.0), state(temperature=1.0, min_p=1.0)]
    for _ in range(5):
        assert draw(logits.clone(), states) == logits.argmax(-1).tolist()


def test_top_k_keeps_draws_within_the_k_best() -> None:
    logits = random_logits(1)
    best = set(logits[0].topk(3).indices.tolist())
    drawn = {draw(logits.clone(), [state(temperature=10.0, top_k=3)])[0] for _ in range(50)}
    assert drawn <= best and len(drawn) > 1


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 7], logits[0, 9], logits[0, 11] = 5.0, 4.5, 0.0  # p ~ 0.62, 0.38, 0.004
    drawn = {draw(logits.clone(), [state(top_p=0.9)])[0] for _ in range(100)}
    assert drawn == {7, 9}


def test_seeded_draws_do_not_depend_on_the_batch() -> None:
    logits = random_logits(6, seed=1)
    params = dict(temperature=1.5, top_p=0.95, seed=1234)
    seeded_alone = state(**params)
    alone = [draw(logits[2:3].clone(), [seeded_alone])[0] for _ in range(8)]
    seeded = state(**params)
    others = [state(temperature=1.0), state(temperature=0), state(temperature=0.7, top_k=5, seed=9)]
    in_batch = []
    for _ in range(8):
        batch = torch.cat([logits[0:2], logits[2:3], logits[3:4]])
        in_batch.append(draw(batch.clone(), [others[0], others[1], seeded, others[2]])[2])
    assert in_batch == alone
    assert len(set(alone)) > 1  # really sampling, not a constant


def test_seeded_draws_do_not_depend_on_the_top_k_of_other_rows() -> None:
    # The batch orders as many candidates as its widest top-k (or the whole vocabulary):
    # a seeded row must still draw the same tokens.
    logits = random_logits(3, seed=2)
    params = dict(temperature=2.0, top_k=10, top_p=1.0, min_p=0.0, seed=77)
    seeded_alone = state(**params)
    alone = [draw(logits[1:2].clone(), [seeded_alone])[0] for _ in range(8)]
    for other_top_k in (0, 30):
        seeded = state(**params)
        others = [state(temperature=1.0, top_k=other_top_k), state(temperature=1.0, top_k=other_top_k)]
        in_batch = [draw(logits.clone(), [others[0], seeded, others[1]])[1] for _ in range(8)]
        assert in_batch == alone, other_top_k
    assert len(set(alone)) > 1


def test_min_p_drops_tokens_below_its_share_of_the_best() -> None:
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, 1.0, -1.0  # p relative to the best: 1, 0.37, 0.05
    drawn = {draw(logits.clone(), [state(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2)])[0] for _ in range(200)}
    assert drawn == {3, 4}


def test_logit_bias_can_force_and_forbid_tokens() -> None:
    logits = random_logits(2)
    forced = state(temperature=0, logit_bias={13: 100.0})
    banned_token = int(logits[1].argmax())
    banned = state(temperature=0, logit_bias={banned_token: -100.0, VOCAB + 5: 3.0})
    tokens = draw(logits.clone(), [forced, banned])
    assert tokens[0] == 13 and tokens[1] != banned_token


def test_repetition_penalty_applies_to_prompt_and_output_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, 1.9, 1.8
    penalized = state(prompt=(3,), generated=(4,), temperature=0, repetition_penalty=1.2)
    assert draw(logits.clone(), [penalized]) == [5]


def test_frequency_and_presence_penalties_count_generated_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 1.0, 0.5
    frequency = state(prompt=(4, 4, 4), temperature=0, frequency_penalty=0.3)
    assert draw(logits.clone(), [frequency]) == [3]  # prompt tokens are not counted
    frequency.record(3)
    assert draw(logits.clone(), [frequency]) == [3]  # 1.0 - 0.3 > 0.5
    frequency.record(3)
    assert draw(logits.clone(), [frequency]) == [4]  # 1.0 - 0.6 < 0.5
    presence = state(generated=(3,), temperature=0, presence_penalty=0.6)
    assert draw(logits.clone(), [presence]) == [4]


def test_unseeded_temperature_sampling_follows_the_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, 1], logits[0, 2] = 0.0, -1.0986  # p = 0.75, 0.25
    draws = [draw(logits.clone(), [state(temperature=1.0)])[0] for _ in range(400)]
    assert set(draws) == {1, 2}
    assert 0.65 < draws.count(1) / len(draws) < 0.85


# ------------------------------------------------------------ logprobs


def reference_logprobs(
    row: list[float], *, temperature: float, top_k: int, top_p: float, min_p: float
) -> dict[int, float]:
    """The documented distribution, computed plainly: scale, keep the top-k, the top-p nucleus and
    the min-p floor, renormalize. Token id -> logprob for the tokens kept."""
    scaled = [value / temperature for value in row]
    order = sorted(range(len(row)), key=lambda token: -scaled[token])
    kept = order[:top_k] if top_k else order

    def normalized(tokens: list[int]) -> dict[int, float]:
        top = max(scaled[t] for t in tokens)
        log_total = top + math.log(sum(math.exp(scaled[t] - top) for t in tokens))
        return {t: scaled[t] - log_total for t in tokens}

    probs = {t: math.exp(lp) for t, lp in normalized(kept).items()}
    nucleus, mass = [], 0.0
    for token in kept:
        if nucleus and mass > top_p:
            break
        nucleus.append(token)
        mass += probs[token]
    best = max(probs[t] for t in nucleus)
    return normalized([t for t in nucleus if probs[t] >= min_p * best])


def test_sampled_logprobs_are_those_of_the_filtered_distribution() -> None:
    logits = random_logits(3, seed=5)
    settings = [
        dict(temperature=0.7, top_k=10, top_p=0.9, min_p=0.0),
        dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.05),
        dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.2),
    ]
    bias = {7: 2.0, 8: -1.0}
    states = [state(seed=row, logprobs=20, logit_bias=bias, **params) for row, params in enumerate(settings)]
    for _ in range(5):
        sampled = sample(logits.clone(), states)
        for row, params in enumerate(settings):
            biased = logits[row].clone()
            for token, value in bias.items():
                biased[token] += value
            expected = reference_logprobs(biased.tolist(), **params)
            report = sampled.logprobs[row]
            assert report.token_id == sampled.tokens[row] in expected
            assert report.logprob == pytest.approx(expected[report.token_id], abs=1e-5)
            best = sorted(expected.items(), key=lambda item: -item[1])[:20]
            assert [token for token, _ in report.top] == [token for token, _ in best]
            assert [value for _, value in report.top] == pytest.approx([value for _, value in best], abs=1e-5)


def test_greedy_logprobs_are_the_adjusted_log_softmax_at_temperature_1() -> None:
    logits = random_logits(2, seed=6)
    greedy = state(temperature=0, logprobs=3, logit_bias={4: 1.5}, presence_penalty=0.5, generated=(9,))
    sampled = sample(logits.clone(), [state(temperature=0), greedy])
    adjusted = logits[1].clone()
    adjusted[4] += 1.5
    adjusted[9] -= 0.5
    expected = adjusted.double().log_softmax(dim=-1)
    report = sampled.logprobs[1]
    assert sampled.logprobs[0] is None  # did not ask
    assert report.top[0][0] == report.token_id == sampled.tokens[1] == int(adjusted.argmax())
    assert report.logprob == pytest.approx(float(expected[report.token_id]), abs=1e-5)
    assert [token for token, _ in report.top] == expected.topk(3).indices.tolist()
    assert [value for _, value in report.top] == pytest.approx(expected.topk(3).values.tolist(), abs=1e-5)


def test_logprobs_never_list_tokens_outside_the_candidates() -> None:
    logits = random_logits(1, seed=7)
    for _ in range(10):
        report = sample(logits.clone(), [state(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, logprobs=5)]).logprobs[0]
        assert len(report.top) == 3
        assert {token for token, _ in report.top} == set(logits[0].topk(3).indices.tolist())
        values = [value for _, value in report.top]
        assert values == sorted(values, reverse=True) and all(math.isfinite(v) for v in values)
        assert math.log(sum(math.exp(v) for v in values)) == pytest.approx(0.0, abs=1e-5)
    zero = sample(logits.clone(), [state(temperature=1.0, logprobs=0)]).logprobs[0]
    assert zero.top == [] and zero.logprob <= 0.0


def test_logprobs_do_not_depend_on_the_batch() -> None:
    logits = random_logits(4, seed=8)
    params = dict(temperature=1.1, top_k=12, top_p=0.95, min_p=0.02, seed=99, logprobs=4)
    seeded_alone = state(**params)
    alone = [sample(logits[1:2].clone(), [seeded_alone]).logprobs[0] for _ in range(6)]
    seeded = state(**params)
    others = [
        state(temperature=1.0, top_k=0, logprobs=2),
        state(temperature=0, logprobs=20),
        state(temperature=0.5, top_k=30),
    ]
    in_batch = [sample(logits.clone(), [others[0], seeded, others[1], others[2]]).logprobs[1] for _ in range(6)]
    assert in_batch == alone
    greedy_alone = sample(logits[2:3].clone(), [state(temperature=0, logprobs=20)]).logprobs[0]
    greedy_in_batch = sample(
        logits.clone(), [others[0], state(**params), state(temperature=0, logprobs=20), others[2]]
    ).logprobs[2]
    assert greedy_in_batch == greedy_alone
