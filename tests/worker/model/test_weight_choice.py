"""`--quant auto` on the CPU: tiered linears, packed dense weights, the measured choice, and its quality.

The quality test holds both weight sets of the auto mode to tests/worker/model/test_reference.py's limits: the
small steps' (int4 linears, int8 output head) by forcing every tiered linear onto its quantized
weights, the large steps' (packed dense copies) by forcing the dense ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model.config import ModelConfig
from worker.model.quant_linear import Int4Linear, Int8Linear, PackedLinear, TieredLinear
from worker.model.weight_choice import ROWS, choose_cpu_weights


class Marker(torch.nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((*x.shape[:-1], 1), self.value)


def test_tiered_linear_takes_the_dense_weights_from_its_row_count_on() -> None:
    tiered = TieredLinear(Marker(1.0), Marker(2.0), dense_from_rows=4)
    assert tiered(torch.zeros(3, 8)).unique().tolist() == [1.0]
    assert tiered(torch.zeros(4, 8)).unique().tolist() == [2.0]
    assert tiered(torch.zeros(2, 2, 8)).unique().tolist() == [2.0]  # rows count across leading dims


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 0.0), (torch.float32, 1e-4)])
def test_packed_linear_computes_what_f_linear_does(dtype: torch.dtype, tolerance: float) -> None:
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 32, generator=generator).to(dtype), torch.randn(48, generator=generator).to(dtype)
    for rows in (1, 5, 33):
        x = torch.randn(rows, 32, generator=generator).to(dtype)
        assert (PackedLinear(weight, bias)(x).float() - F.linear(x, weight, bias).float()).abs().max() <= tolerance


def tiny_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_context=128, tie_word_embeddings=True,
    )  # fmt: skip


def test_the_choice_is_a_measured_candidate() -> None:
    choice = choose_cpu_weights(tiny_config(), torch.bfloat16, dense_bytes=1 << 20)
    assert choice.quant in ("int4", "int8")
    assert choice.dense_from_rows is None or choice.dense_from_rows in ROWS
    assert set(choice.micros) == {"int4", "int8", "dense"}
    assert all(set(times) == set(ROWS) and min(times.values()) > 0 for times in choice.micros.values())


def test_no_dense_copies_when_they_would_not_fit() -> None:
    choice = choose_cpu_weights(tiny_config(), torch.bfloat16, dense_bytes=1 << 50)
    assert choice.dense_from_rows is None and "dense" not in choice.micros


@pytest.mark.slow
def test_both_weight_sets_of_the_auto_mode_stay_close_to_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.engine.quality import chat_logits, compare
    from tests.support.reference_data import load_reference
    from tests.worker.model.test_reference import LIMITS
    from worker.model import loader

    monkeypatch.setattr(loader, "MEASURE_WEIGHTS", True)
    chats = load_reference()["chat"]
    float32 = chat_logits(loader.load_model(dtype="float32", quant="none", device="cpu"), chats)
    auto = loader.load_model(device="cpu")
    tiered = [module for module in auto.model.modules() if isinstance(module, TieredLinear)]
    assert auto.dense_from_rows is not None and len(tiered) == 4 * auto.config.num_layers + 1  # the head too
    for dense_from_rows, limits in ((1 << 30, LIMITS[("bfloat16", auto.quant)]), (1, LIMITS[("bfloat16", "none")])):
        for module in tiered:
            module.dense_from_rows = dense_from_rows
        quality = compare(float32, chat_logits(auto, chats))
        assert quality.mean_kl < limits.max_mean_kl, (dense_from_rows, quality)
        assert quality.max_kl < limits.max_kl, (dense_from_rows, quality)
        assert quality.clear_top1 >= limits.min_clear_top1, (dense_from_rows, quality)


@pytest.mark.slow
def test_the_default_cpu_mode_runs_small_steps_on_int4_long_prompts_on_dense_copies() -> None:
    """With the measured choice off, `auto` is int4 linears with packed dense copies from DENSE_FROM_ROWS rows,
    and the output head on int8 weights below HEAD_INT8_BELOW rows."""
    from worker.model import loader

    auto = loader.load_model(device="cpu")
    head = auto.model.lm_head
    assert (
        isinstance(head, TieredLinear) and isinstance(head.small, Int8Linear) and isinstance(head.dense, PackedLinear)
    )
    assert head.dense_from_rows == auto.head_int8_below == loader.HEAD_INT8_BELOW
    gate_up = auto.model.layers[0].gate_up
    assert (
        isinstance(gate_up, TieredLinear)
        and isinstance(gate_up.small, Int4Linear)
        and isinstance(gate_up.dense, PackedLinear)
    )
    assert gate_up.dense_from_rows == auto.dense_from_rows == loader.DENSE_FROM_ROWS
