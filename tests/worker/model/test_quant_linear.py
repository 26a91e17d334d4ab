"""Quantized linear layers compute x @ dequantized(W).T, and their quantization error is bounded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model.quant_linear import Int4Linear, Int8Linear, quantize_int4


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(48, 96, generator=torch.Generator().manual_seed(0))


def test_int4_quantization_error_is_at_most_half_a_step(weight: torch.Tensor) -> None:
    blocks = quantize_int4(weight)
    step = blocks.scale.repeat_interleave(32, dim=1)
    assert ((blocks.dequantize() - weight).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_int4_linear_multiplies_by_its_dequantized_weight(
    weight: torch.Tensor, dtype: torch.dtype, tolerance: float
) -> None:
    blocks = quantize_int4(weight)
    bias = torch.randn(48)
    x = torch.randn(2, 5, 96)
    out = Int4Linear(blocks, bias, dtype)(x.to(dtype))
    assert out.shape == (2, 5, 48) and out.dtype == dtype
    expected = F.linear(x, blocks.dequantize(), bias)
    torch.testing.assert_close(out.float(), expected, atol=tolerance * expected.abs().max(), rtol=0)


def test_int8_linear_stays_within_quantization_error(weight: torch.Tensor) -> None:
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    out = Int8Linear(weight, None, torch.float32)(x)
    expected = F.linear(x, weight)
    # Symmetric per-row int8 rounds each weight by at most half a step, max|w_row| / 254.
    bound = x.abs().sum(-1, keepdim=True) * weight.abs().amax(-1) / 254
    assert ((out - expected).abs() <= bound + 1e-5).all()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_step_with_no_logit_rows_gets_an_empty_answer(weight: torch.Tensor, kind: str) -> None:
    """A prompt chunk that samples nothing asks the head for zero rows: a 1,163-token prompt on a GGUF
    whose head is int8 on the torch path (llama-quantize's Qwen3 Q4_0) failed with HTTP 500."""
    layer = (
        Int8Linear(weight, None, torch.float32)
        if kind == "int8"
        else Int4Linear(quantize_int4(weight), None, torch.float32)
    )
    assert layer(torch.zeros(0, weight.shape[1])).shape == (0, weight.shape[0])


def test_int8_weights_quantized_from_a_table_read_by_rows_are_the_ones_from_the_whole_table(
    weight: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output head's int8 tier is built from its file a slice of rows at a time (worker/model/weights.py's
    TableRows), each slice rounded to the dtype as the whole table would be: the same weights and scales."""
    from worker.model import quant_linear
    from worker.model.weights import TableRows

    monkeypatch.setattr(quant_linear, "QUANTIZE_ROWS", 20)  # 48 rows: slices of 20, 20 and 8
    reads: list[tuple[int, int]] = []

    def read(start: int, stop: int) -> torch.Tensor:
        reads.append((start, stop))
        return weight[start:stop].to(torch.bfloat16)

    by_rows = Int8Linear(TableRows((48, 96), read), None, torch.bfloat16)
    whole = Int8Linear(weight.to(torch.bfloat16), None, torch.bfloat16)
    assert reads == [(0, 20), (20, 40), (40, 48)]
    assert torch.equal(by_rows.qweight, whole.qweight) and torch.equal(by_rows.scale, whole.scale)
