"""bench/engine/linear_crossover.py: the measurement picks among the candidates it measured."""

from __future__ import annotations

import torch

from bench.engine.linear_crossover import ROWS, choose_cpu_weights
from worker.model.config import ModelConfig
from worker.model.quant_linear import packed_linear_supported


def tiny_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_context=128, tie_word_embeddings=True,
    )  # fmt: skip


def test_the_choice_is_a_measured_candidate() -> None:
    choice = choose_cpu_weights(tiny_config(), torch.bfloat16, dense_bytes=1 << 20)
    assert choice.quant in ("int4", "int8")
    assert choice.dense_from_rows is None or choice.dense_from_rows in ROWS
    dense = {"dense"} if packed_linear_supported(torch.device("cpu"), torch.bfloat16) else set()  # not on AVX2 alone
    assert set(choice.micros) == {"int4", "int8"} | dense
    assert all(set(times) == set(ROWS) and min(times.values()) > 0 for times in choice.micros.values())


def test_no_dense_copies_when_they_would_not_fit() -> None:
    choice = choose_cpu_weights(tiny_config(), torch.bfloat16, dense_bytes=1 << 50)
    assert choice.dense_from_rows is None and "dense" not in choice.micros
