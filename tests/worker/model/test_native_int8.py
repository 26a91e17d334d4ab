"""The native linears on int8 activations (worker/native/int8_linear.h), every GGUF type they read.

The int8 tier reads the same packed blocks as the int16 one (no second copy of the weights), unpacked to
u8 quads with x reordered to match; its only rounding beyond float32's is x's, to int8 with one scale per
16 values. So its outputs must be the dequantized matmul over that rounded x, within float32 rounding of
the sums (and of the offsets it folds in: a Q8_0 weight is held as q + 128, a Q6_K one as q + 32): a
wrong quad, bit plane or offset would be far outside that. Then the step: a batched decode on int8 against
the same decode on int16.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.support.gguf_blocks import raw_tensor
from worker.model.gguf_blocks import FORMATS, gguf_blocks
from worker.model.native_pack import matrix, pack_parts
from worker.model.weights import QuantBlocks
from worker.native import build

pytestmark = pytest.mark.skipif(
    build.missing_requirements() is not None, reason=f"native: {build.missing_requirements()}"
)


def native_linear_int8(parts: list[QuantBlocks], x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    library = build.load()
    library.lmq_linear_int8.restype = ctypes.c_int
    keep: list = []
    packed = pack_parts(parts)
    struct = matrix(packed, keep)
    out = torch.full((x.shape[0], sum(p.n for p in packed)), float("nan"))
    x = x.contiguous()
    status = library.lmq_linear_int8(
        ctypes.byref(struct), ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]),
        ctypes.c_void_p(out.data_ptr()), threads,
    )  # fmt: skip
    assert status == 0
    return out


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 tier multiplies it: per 16 values d * round(x * 127 / amax), d = amax / 127 (float32)."""
    rows, k = x.shape
    v = x.view(rows, k // 16, 16)
    amax = v.abs().amax(dim=-1, keepdim=True)
    q = torch.round(v * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    return (q * (amax / 127.0)).view(rows, k)


BIAS = {6: 32, 8: 128}  # signed weights are held as u8 q + this (a table format's values less their least)


def float_bound(blocks: QuantBlocks, x: torch.Tensor) -> torch.Tensor:
    """float32's share of the error: relative to the terms summed, |a| (|q| + bias) + |m| per weight."""
    scale = blocks.scale.abs().repeat_interleave(blocks.group, dim=1)
    bias = -int(blocks.values.min()) if blocks.values is not None else BIAS.get(blocks.bits, 0)
    held = scale * (blocks.weights().abs().float() + bias)
    if blocks.min is not None:
        held = held + blocks.min.abs().repeat_interleave(blocks.group, dim=1)
    return 1e-5 * (x.abs().double() @ held.double().T)


@pytest.mark.parametrize("rows", [1, 3, 9, 21])  # 21: a tile of 16 rows and one of 5, all in registers
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_int8_linear_is_the_dequantized_matmul_of_the_int8_rounded_x(qtype: QType, rows: int) -> None:
    n, k = 48, 512
    blocks = gguf_blocks(raw_tensor(qtype, n, k), qtype, n, k)
    weights = blocks.dequantize().double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * torch.logspace(-1, 1, k)
    exact = int8_rounded(x).double() @ weights.T
    error = (native_linear_int8([blocks], x).double() - exact).abs()
    bound = float_bound(blocks, x)
    assert (error <= bound).all(), f"worst error / bound {(error / bound).max():.3f}"
    # not loose enough to hide a wrong quad: x's own int8 rounding moves the outputs far more than this
    assert bound.max() < 0.1 * (exact - x.double() @ weights.T).abs().max()


def test_a_fused_matrix_of_three_types_runs_each_part_on_its_own_int8_kernel() -> None:
    k = 512
    parts = [
        gguf_blocks(raw_tensor(t, n, k, seed), t, n, k)
        for t, n, seed in [(QType.Q5_0, 32, 1), (QType.Q8_0, 16, 2), (QType.Q6_K, 16, 3)]
    ]
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(0))
    one_thread, two_threads = native_linear_int8(parts, x, threads=1), native_linear_int8(parts, x, threads=2)
    assert torch.equal(one_thread, two_threads)
    exact = int8_rounded(x).double() @ torch.cat([p.dequantize() for p in parts]).double().T
    assert ((two_threads.double() - exact).abs() <= torch.cat([float_bound(p, x) for p in parts], dim=1)).all()
