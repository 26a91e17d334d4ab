"""The batched sampler: greedy is argmax, filters and penalties act per row, seeds are per request."""

from __future__ import annotations

import torch

from protocol import SamplingParams
from worker.sampler import SamplingState, sample

VOCAB = 50


def state(prompt: tuple[int, ...] = (), generated: tuple[int, ...] = (), **params) -> SamplingState:
    return SamplingState(
        SamplingParams(**params), prompt_ids=prompt, generated_ids=generated, vocab_size=VOCAB, device=torch.device("cpu")
    )


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = random_logits(4)
    assert sample(logits.clone(), [state(temperature=0)] * 4) == logits.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_pick_the_argmax() -> None:
    logits = random_logits(3)
    states = [state(temperature=1.0, top_k=1), state(temperature=5.0, top_p=0.0), state(temperature=1.0, min_p=1.0)]
    for _ in range(5):
        assert sample(logits.clone(), states) == logits.argmax(-1).tolist()


def test_top_k_keeps_draws_within_the_k_best() -> None:
    logits = random_logits(1)
    best = set(logits[0].topk(3).indices.tolist())
    drawn = {sample(logits.clone(), [state(temperature=10.0, top_k=3)])[0] for _ in range(50)}
    assert drawn <= best and len(drawn) > 1


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 7], logits[0, 9], logits[0, 11] = 5.0, 4.5, 0.0  # p ~ 0.62, 0.38, 0.004
    drawn = {sample(logits.clone(), [state(top_p=0.9)])[0] for _ in range(100)}
    assert drawn == {7, 9}


def test_seeded_draws_do_not_depend_on_the_batch() -> None:
    logits = random_logits(6, seed=1)
    params = dict(temperature=1.5, top_p=0.95, seed=1234)
    seeded_alone = state(**params)
    alone = [sample(logits[2:3].clone(), [seeded_alone])[0] for _ in range(8)]
    seeded = state(**params)
    others = [state(temperature=1.0), state(temperature=0), state(temperature=0.7, top_k=5, seed=9)]
    in_batch = []
    for _ in range(8):
        batch = torch.cat([logits[0:2], logits[2:3], logits[3:4]])
        in_batch.append(sample(batch.clone(), [others[0], others[1], seeded, others[2]])[2])
    assert in_batch == alone
    assert len(set(alone)) > 1  # really sampling, not a constant


def test_seeded_draws_do_not_depend_on_the_top_k_of_other_rows() -> None:
    # The batch orders as many candidates as its widest top-k (or the whole vocabulary):
    # a seeded row must still draw the same tokens.
    logits = random_logits(3, seed=2)
    params = dict(temperature=2.0, top_k=10, top_p=1.0, min_p=0.0, seed=77)
    seeded_alone = state(**params)
    alone = [sample(logits[1:2].clone(), [seeded_alone])[0] for _ in range(8)]
    for other_top_k in (0, 30):
        seeded = state(**params)
        others = [state(temperature=1.0, top_k=other_top_k), state(temperature=1.0, top_k=other_top_k)]
        in_batch = [sample(logits.clone(), [others[0], seeded, others[1]])[1] for _ in range(8)]
        assert in_batch == alone, other_top_k
    assert len(set(alone)) > 1


def test_min_p_drops_tokens_below_its_share_of_the_best() -> None:
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, 1.0, -1.0  # p relative to the best: 1, 0.37, 0.05
    drawn = {sample(logits.clone(), [state(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2)])[0] for _ in range(200)}
    assert drawn == {3, 4}


def test_logit_bias_can_force_and_forbid_tokens() -> None:
    logits = random_logits(2)
    forced = state(temperature=0, logit_bias={13: 100.0})
    banned_token = int(logits[1].argmax())
    banned = state(temperature=0, logit_bias={banned_token: -100.0, VOCAB + 5: 3.0})
    tokens = sample(logits.clone(), [forced, banned])
    assert tokens[0] == 13 and tokens[1] != banned_token


def test_repetition_penalty_applies_to_prompt_and_output_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, 1.9, 1.8
    penalized = state(prompt=(3,), generated=(4,), temperature=0, repetition_penalty=1.2)
    assert sample(logits.clone(), [penalized]) == [5]


def test_frequency_and_presence_penalties_count_generated_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 1.0, 0.5
    frequency = state(prompt=(4, 4, 4), temperature=0, frequency_penalty=0.3)
    assert sample(logits.clone(), [frequency]) == [3]  # prompt tokens are not counted
    frequency.record(3)
    assert sample(logits.clone(), [frequency]) == [3]  # 1.0 - 0.3 > 0.5
    frequency.record(3)
    assert sample(logits.clone(), [frequency]) == [4]  # 1.0 - 0.6 < 0.5
    presence = state(generated=(3,), temperature=0, presence_penalty=0.6)
    assert sample(logits.clone(), [presence]) == [4]


def test_unseeded_temperature_sampling_follows_the_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, 1], logits[0, 2] = 0.0, -1.0986  # p = 0.75, 0.25
    draws = [sample(logits.clone(), [state(temperature=1.0)])[0] for _ in range(400)]
    assert set(draws) == {1, 2}
    assert 0.65 < draws.count(1) / len(draws) < 0.85
