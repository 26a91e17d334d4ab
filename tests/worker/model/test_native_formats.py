"""The native linears on every GGUF type they read (worker/native/quant_linear.h, worker/model/native_pack.py).

Each type's blocks are written the way files hold them (gguf.quants.quantize where the package has a
quantizer, random blocks with modest scales for the K-quants, which it only dequantizes), unpacked
exactly (against gguf's own dequantizer), packed, and multiplied natively against a float32 matmul over
the dequantized weights. The only error allowed is the activations' int16 rounding: x is quantized per
group of 32 to d * qx with d = amax / 32767, so each x_j is off by at most d / 2 and output i by at most
sum_j |w_ij| d_j / 2, plus float32 rounding of the sums.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from tests.support.gguf_blocks import raw_tensor
from worker.model.gguf_blocks import FORMATS, gguf_blocks, gguf_int4_blocks
from worker.model.native_pack import (
    PACKED_FIELDS,
    PackedMatrix,
    _by_block,
    kernel_format,
    matrix,
    pack,
    pack_by_rows,
    pack_parts,
)
from worker.model.weights import QuantBlocks
from worker.native import build

pytestmark = pytest.mark.skipif(
    build.missing_requirements() is not None, reason=f"native: {build.missing_requirements()}"
)

EXPECTED_FORMATS = {
    QType.Q4_0: "int4/fp16/32",
    QType.Q4_1: "int4/fp16/32",
    QType.Q5_0: "int5/fp16/32",
    QType.Q5_1: "int5/fp16/32",
    QType.Q8_0: "int8/fp16/32",
    QType.Q4_K: "int4/k8/32",  # its own 8-bit sc per 32 and fp16 d per 256
    QType.Q5_K: "int5/k8/32",
    QType.Q6_K: "int6/k8/16",
    QType.Q3_K: "table4/k8/16",  # 4-bit indices into -4..3
    QType.IQ4_NL: "table4/fp16/32",  # into ggml's 16 int8 values
    QType.IQ4_XS: "table4/k8/32",
}


def native_linear(parts: list[QuantBlocks], x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    return native_linear_packed(pack_parts(parts), x, threads)


def native_linear_packed(packed: list[PackedMatrix], x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    library = build.load()
    library.lmq_linear.restype = ctypes.c_int
    keep: list = []
    struct = matrix(packed, keep)
    n = sum(part.n for part in packed)
    out = torch.full((x.shape[0], n), float("nan"))
    x = x.contiguous()
    status = library.lmq_linear(
        ctypes.byref(struct),
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_int64(x.shape[0]),
        ctypes.c_void_p(out.data_ptr()),
        threads,
    )
    assert status == 0
    return out


def activation_bound(weights: torch.Tensor, magnitudes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[rows, n]: the most int16 rounding of x (d / 2 per value) can move each output, plus float32's share."""
    rows, k = x.shape
    d = x.view(rows, k // 32, 32).abs().amax(dim=-1) / 32767
    half_steps = (d / 2).repeat_interleave(32, dim=1)  # [rows, k]
    return half_steps.double() @ weights.abs().double().T + 1e-5 * (x.abs().double() @ magnitudes.double().T)


def magnitudes(blocks: QuantBlocks) -> torch.Tensor:
    """|a q| + |m| per weight: what float32 rounding of the two terms is relative to."""
    n, k = blocks.q.shape
    scaled = (blocks.weights().float().view(n, -1, blocks.group) * blocks.scale[..., None]).abs()
    if blocks.min is not None:
        scaled = scaled + blocks.min.abs()[..., None]
    return scaled.view(n, k)


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_blocks_unpack_exactly_like_gguf_dequantize(qtype: QType) -> None:
    rows, columns = 32, 512
    raw = raw_tensor(qtype, rows, columns)
    blocks = gguf_blocks(raw, qtype, rows, columns)
    expected = torch.from_numpy(dequantize(raw, qtype).reshape(rows, columns).astype(np.float32))
    assert torch.equal(blocks.dequantize(), expected)
    assert kernel_format(blocks) == f"{qtype.name} as {EXPECTED_FORMATS[qtype]}"


@pytest.mark.parametrize("rows", [1, 3, 9, 21])  # 9 and 21: tiles of 16 rows, accumulators in L1
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_native_linear_is_the_dequantized_matmul_up_to_x_rounding(qtype: QType, rows: int) -> None:
    n, k = 48, 512
    blocks = gguf_blocks(raw_tensor(qtype, n, k), qtype, n, k)
    weights = blocks.dequantize()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * torch.logspace(
        -1, 1, k
    )  # groups of unequal size
    error = (native_linear([blocks], x).double() - x.double() @ weights.double().T).abs()
    bound = activation_bound(weights, magnitudes(blocks), x)
    assert (error <= bound).all(), f"worst error / bound {(error / bound).max():.3f}"
    # and the bound is not loose enough to hide a wrong kernel: a wrong scale or pair would be far outside it
    assert bound.max() < 1e-3 * (x.abs().double() @ weights.abs().double().T).max()


def test_a_fused_matrix_of_three_types_runs_each_part_on_its_own_kernel() -> None:
    k = 512
    parts = [
        gguf_blocks(raw_tensor(t, n, k, seed), t, n, k)
        for t, n, seed in [(QType.Q5_0, 32, 1), (QType.Q8_0, 16, 2), (QType.Q6_K, 16, 3)]
    ]
    assert len(pack_parts(parts)) == 3
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    weights = torch.cat([p.dequantize() for p in parts])
    one_thread, two_threads = native_linear(parts, x, threads=1), native_linear(parts, x, threads=2)
    assert torch.equal(one_thread, two_threads)  # a column's arithmetic does not depend on the team
    error = (two_threads.double() - x.double() @ weights.double().T).abs()
    assert (error <= activation_bound(weights, torch.cat([magnitudes(p) for p in parts]), x)).all()


def test_parts_of_one_layout_pack_as_one() -> None:
    k = 256
    q4_0, q4_1, q4_k = (gguf_blocks(raw_tensor(t, 16, k), t, 16, k) for t in (QType.Q4_0, QType.Q4_1, QType.Q4_K))
    packed = pack_parts([q4_0, q4_1, q4_k])
    assert [(p.n, p.qtypes, p.scale_bytes) for p in packed] == [(32, ("Q4_0", "Q4_1"), 2), (16, ("Q4_K",), 1)]


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q5_K, QType.Q6_K], ids=lambda t: t.name)
def test_k_quants_own_scales_multiply_out_to_the_loaders_float32_ones(qtype: QType) -> None:
    """The kernel reads a K-quant's 8-bit sc and fp16 d (its file's bytes); the products it forms are
    the float32 scale and min the loader computes: bit-identical to running on those."""
    n, k = 32, 768
    blocks = gguf_blocks(raw_tensor(qtype, n, k, seed=5), qtype, n, k)
    flat = dataclasses.replace(blocks, super=None)
    assert kernel_format(flat).endswith("f32/" + str(blocks.group))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(1))
    assert torch.equal(native_linear([blocks], x), native_linear([flat], x))


@pytest.mark.parametrize(("qtype", "bits_per_weight"), [(QType.Q4_0, 4.5), (QType.Q5_0, 5.5)], ids=["Q4_0", "Q5_0"])
def test_q4_0_and_q5_0_keep_no_mins_and_give_the_same_outputs_as_stored_ones(qtype: QType, bits_per_weight) -> None:
    """Their min is -8 (-16) times the scale: the kernel forms it from the scale, so the packed matrix is
    the file's size (a one-row step reads every byte of it), and the outputs are bit for bit those of the
    same blocks with their mins stored (the layout Q4_1 and Q5_1 run on)."""
    n, k = 48, 512
    blocks = gguf_blocks(raw_tensor(qtype, n, k, seed=3), qtype, n, k)
    (packed,) = pack_parts([blocks])
    assert packed.mins is None and packed.m_factor == -(1 << (blocks.bits - 1))
    assert packed.nbytes() * 8 / (n * k) == bits_per_weight
    stored = dataclasses.replace(packed, mins=_by_block(blocks.min.half()), m_factor=0)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2)) * torch.logspace(-1, 1, k)
    assert torch.equal(native_linear_packed([packed], x), native_linear_packed([stored], x))


@pytest.mark.parametrize(
    ("qtype", "bits_per_weight", "wide_bits"),
    [(QType.Q3_K, 4.5625, 6), (QType.IQ4_NL, 4.5, 8), (QType.IQ4_XS, 4.3125, 8)],
    ids=["Q3_K", "IQ4_NL", "IQ4_XS"],
)
def test_a_table_format_keeps_4_bit_indices_and_gives_the_outputs_of_its_values_held_wide(
    qtype: QType, bits_per_weight: float, wide_bits: int
) -> None:
    """Q3_K's q and IQ4's values fit Q6_K's and Q8_0's formats exactly, at 6.56 and 8.5 bits a weight; held as
    4-bit indices into their 16 values (a one-row step reads every byte) the outputs are bit for bit the same."""
    n, k = 48, 512
    blocks = gguf_blocks(raw_tensor(qtype, n, k, seed=4), qtype, n, k)
    (packed,) = pack_parts([blocks])
    assert kernel_format(blocks).split(" as ")[1].startswith("table4/")
    assert (packed.nbytes() - packed.values.numel()) * 8 / (n * k) == bits_per_weight
    wide = dataclasses.replace(blocks, q=blocks.weights(), bits=wide_bits, values=None)
    assert not kernel_format(wide).split(" as ")[1].startswith("table4/")
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2)) * torch.logspace(-1, 1, k)
    assert torch.equal(native_linear([blocks], x), native_linear([wide], x))


@pytest.mark.parametrize("qtype", [QType.IQ4_NL, QType.IQ4_XS], ids=lambda t: t.name)
def test_a_table_format_s_4_bit_indices_are_never_taken_for_int4_weights(qtype: QType) -> None:
    """IQ4's indices are 4 bits in groups of 32, as Q4_0's q are: the torch path's int4 kernel must dequantize them
    through the table rather than read the indices as weights."""
    raw = raw_tensor(qtype, 32, 256, seed=5)
    assert gguf_int4_blocks(raw, qtype, 32, 256) is None
    assert gguf_int4_blocks(raw_tensor(QType.Q4_0, 32, 256), QType.Q4_0, 32, 256) is not None


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_a_matrix_packed_a_slice_of_rows_at_a_time_is_the_one_packed_whole(
    qtype: QType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The output head is packed from its file's blocks by slices of rows (never decoded whole): the same tensors."""
    from worker.model import native_pack

    monkeypatch.setattr(native_pack, "PACK_ROWS", 32)
    rows, columns = 80, 512  # slices of 32, 32 and 16 rows
    raw = raw_tensor(qtype, rows, columns, seed=3)
    reads = []

    def blocks_of(start: int, stop: int) -> QuantBlocks:
        reads.append((start, stop))
        return gguf_blocks(raw[start:stop], qtype, stop - start, columns)

    by_rows, whole = pack_by_rows(blocks_of, rows), pack(gguf_blocks(raw, qtype, rows, columns))
    assert reads == [(0, 32), (32, 64), (64, 80)]
    assert (by_rows.n, by_rows.k, by_rows.bits, by_rows.group, by_rows.m_factor, by_rows.qtypes) == (
        whole.n,
        whole.k,
        whole.bits,
        whole.group,
        whole.m_factor,
        whole.qtypes,
    )
    for name in PACKED_FIELDS:
        mine, theirs = getattr(by_rows, name), getattr(whole, name)
        assert (mine is None and theirs is None) or (mine.dtype == theirs.dtype and torch.equal(mine, theirs))


def test_slices_of_rows_that_pack_to_different_formats_are_refused() -> None:
    exact = gguf_blocks(raw_tensor(QType.Q4_1, 16, 64), QType.Q4_1, 16, 64)
    inexact = dataclasses.replace(exact, scale=exact.scale * (1 + 2**-20))  # not fp16: float32 scales
    with pytest.raises(ValueError, match="another format"):
        pack_by_rows(lambda start, stop: exact if start == 0 else inexact, 4096)
