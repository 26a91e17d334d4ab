"""`--quant auto` on the CPU: tiered linears, packed dense weights, and what the default mode keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model.lazy_linear import build_linears
from worker.model.quant_linear import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    PackedLinear,
    TieredLinear,
    packed_linear_supported,
)


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
    if not packed_linear_supported(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU")
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 32, generator=generator).to(dtype), torch.randn(48, generator=generator).to(dtype)
    for rows in (1, 5, 33):
        x = torch.randn(rows, 32, generator=generator).to(dtype)
        assert (PackedLinear(weight, bias)(x).float() - F.linear(x, weight, bias).float()).abs().max() <= tolerance


@pytest.mark.slow
def test_the_default_cpu_mode_runs_small_steps_on_int4_long_prompts_on_dense_copies() -> None:
    """`auto` is int4 linears with packed dense copies from DENSE_FROM_ROWS rows,
    and the output head on int8 weights below HEAD_INT8_BELOW rows. Where oneDNN packs no bfloat16 (an AVX2-only
    CPU) the head's dense tier is a plain linear and the layers keep no dense copies."""
    from worker.model import loader

    auto = loader.load_model(device="cpu")
    build_linears(auto.model)  # left for the torch path to build (worker/model/lazy_linear.py): what it builds
    packs = packed_linear_supported(torch.device("cpu"), torch.bfloat16)
    head = auto.model.lm_head
    assert isinstance(head, TieredLinear) and isinstance(head.small.built, Int8Linear)
    assert isinstance(head.dense.built, PackedLinear if packs else DenseLinear)
    assert head.dense_from_rows == auto.head_int8_below == loader.HEAD_INT8_BELOW
    gate_up = auto.model.layers[0].gate_up.built
    if not packs:
        assert isinstance(gate_up, Int4Linear) and auto.dense_from_rows is None
        return
    assert (
        isinstance(gate_up, TieredLinear)
        and isinstance(gate_up.small, Int4Linear)
        and isinstance(gate_up.dense, PackedLinear)
    )
    assert gate_up.dense_from_rows == auto.dense_from_rows == loader.DENSE_FROM_ROWS


def test_the_tiered_head_builds_where_onednn_has_no_bfloat16_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AVX2-only CPU (AMD Zen 3) oneDNN cannot pack bfloat16 weights (its reorder raises), so the head's
    dense tier is a plain linear there, with the same results; the dense copies of the layers are not kept."""
    from worker.model import quant_linear
    from worker.model.dense_copies import dense_copies_fit
    from worker.model.weight_builder import WeightBuilder

    monkeypatch.setattr(quant_linear, "onednn_packs_bfloat16", lambda: False)
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    from worker.model.weights import TensorSource

    source = TensorSource(shape=(64, 32), load=lambda: weight)
    builder = WeightBuilder({"head": source}, torch.bfloat16, "int4", torch.device("cpu"), head_int8_below=4)
    head = builder.head("head")
    x = torch.randn(8, 32).to(torch.bfloat16)
    assert torch.equal(head(x), F.linear(x, weight.to(torch.bfloat16)))
    assert not dense_copies_fit(torch.bfloat16, 1)


def test_a_long_prompts_dense_copy_holds_the_files_own_values_not_an_int4_requantization() -> None:
    """A matrix the file keeps in more than 4 bits (a Q4_K_M file's Q5_0, Q6_K and Q8_0 ones) has no int4 blocks, so
    the torch path's small tier re-quantizes it to int4; the dense copy that long prompts run on (on a CPU with
    AMX: steps of DENSE_FROM_ROWS rows or more, docs/models.md) is the file's own values in the dtype, as the
    native step that serves the same model's other steps reads them, not that re-quantization."""
    from worker.model.weight_builder import WeightBuilder
    from worker.model.weights import TensorSource

    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    builder = WeightBuilder(
        {"w": TensorSource(shape=(64, 64), load=lambda: weight.clone())},
        torch.bfloat16,
        "int4",
        torch.device("cpu"),
        dense_from_rows=4,
    )
    linear = builder.linear(["w"])
    assert isinstance(linear, TieredLinear) and isinstance(linear.small, Int4Linear)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(linear(x), F.linear(x, weight.to(torch.bfloat16)))
