"""`--quant auto` on the CPU: tiered linears, packed dense weights, and what the default mode keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model.quant_linear import Int4Linear, Int8Linear, PackedLinear, TieredLinear


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


@pytest.mark.slow
def test_the_default_cpu_mode_runs_small_steps_on_int4_long_prompts_on_dense_copies() -> None:
    """`auto` is int4 linears with packed dense copies from DENSE_FROM_ROWS rows,
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
