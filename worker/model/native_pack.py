"""Weights packed for the native step's linears (worker/native/quant_linear.h), one format per matrix.

`pack(blocks)` lays out a QuantBlocks (integer q, a scale and a min per group: every GGUF type the
native step reads, exactly as the file holds it) in the kernel's layout for its bits, with fp16 scales
where every scale and min of the matrix is exactly an fp16 (the files' own d and m) and float32 where
not (K-quant products d * sc). Q4_0 and Q5_0, whose min is -8 and -16 times the scale, keep no mins: the
kernel forms m from a (exactly), so their blocks cost the file's 4.5 and 5.5 bits a weight, not 5.0 and 6.0. `matrix(parts, keep)` makes the ctypes struct a step points to: parts
of a fused matrix (q, k, v) in different formats chain, each running on its own kernel.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from worker.model.quant_linear import quantize_int4
from worker.model.weights import QuantBlocks, TensorSource

BLOCK_N = 16  # output rows the kernel computes together
GROUP = 32  # input values per group of x (its int16 scale)
PACK_ROWS = 2048  # output rows packed at a time (a multiple of BLOCK_N)


class QuantMatrix(ctypes.Structure):
    pass


QuantMatrix._fields_ = [
    ("weights", ctypes.c_void_p),
    ("scales", ctypes.c_void_p),
    ("mins", ctypes.c_void_p),
    ("super_scales", ctypes.c_void_p),
    ("super_mins", ctypes.c_void_p),
    ("n", ctypes.c_int64),
    ("k", ctypes.c_int64),
    ("bits", ctypes.c_int32),
    ("scale_bytes", ctypes.c_int32),
    ("group", ctypes.c_int32),
    ("m_factor", ctypes.c_int32),
    ("values", ctypes.c_void_p),
    ("next", ctypes.POINTER(QuantMatrix)),
]


PACKED_FIELDS = ("weights", "scales", "mins", "super_scales", "super_mins")  # each [N/16, ...]


@dataclass
class PackedMatrix:
    """One format's rows of a matrix as the kernel reads them; qtypes: the file types they came from."""

    weights: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    n: int
    k: int
    bits: int
    group: int
    qtypes: tuple[str, ...]
    super_scales: torch.Tensor | None = None  # K-quants: fp16 d [N/16, K/256, 16], scales then their 8-bit sc
    super_mins: torch.Tensor | None = None
    m_factor: int = 0  # Q4_0 -8, Q5_0 -16: no mins stored, m = m_factor * scale (mins None)
    values: torch.Tensor | None = None  # a table format's 16 int8 values, which the 4-bit weights index

    @property
    def scale_bytes(self) -> int:
        return self.scales.element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        parts = (self.weights, self.scales, self.mins, self.super_scales, self.super_mins, self.values)
        return [t for t in parts if t is not None]


def kernel_format(blocks: QuantBlocks) -> str:
    """The file's type and how the kernel reads it: bits, scales, group; e.g. "Q5_0 as int5/fp16/32".

    Scales: fp16 or f32 per group, or "k8": a K-quant's own 8-bit sc per group times an fp16 d per 256.
    Weights "table4": 4-bit indices into the type's 16 values (Q3_K, IQ4_NL, IQ4_XS).
    """
    fp16 = _fp16_exact(blocks) or _min_factor(blocks) != 0
    scales = "k8" if blocks.super is not None else "fp16" if fp16 else "f32"
    weights = f"int{blocks.bits}" if blocks.values is None else "table4"
    return f"{blocks.qtype} as {weights}/{scales}/{blocks.group}"


def pack(blocks: QuantBlocks) -> PackedMatrix:
    n, k = blocks.q.shape
    if n % BLOCK_N or k % GROUP:
        raise ValueError(f"a native matrix needs rows in multiples of {BLOCK_N} and columns of {GROUP}, not {n}x{k}")
    # Row by row of blocks: the bit-twiddling's int32 temporaries take ~12 bytes a weight (1.2 GB at once for a
    # 49152 x 2048 head), so a whole matrix at a time set the load's peak memory.
    weights = torch.cat([_weights(blocks.q[rows : rows + PACK_ROWS], blocks.bits) for rows in range(0, n, PACK_ROWS)])
    qtypes, values = (blocks.qtype,), blocks.values
    if blocks.super is not None:
        levels = blocks.super
        sub = torch.int8 if blocks.bits >= 6 or values is not None else torch.uint8
        mins = None if levels.mn is None else _by_block(levels.mn.to(torch.uint8))
        dmin = None if levels.dmin is None else _by_block(levels.dmin.half())
        scales, d = _by_block(levels.sc.to(sub)), _by_block(levels.d.half())
        return PackedMatrix(weights, scales, mins, n, k, blocks.bits, blocks.group, qtypes, d, dmin, values=values)
    factor = _min_factor(blocks)
    if factor:
        scales = _by_block(blocks.scale.half())
        return PackedMatrix(weights, scales, None, n, k, blocks.bits, blocks.group, qtypes, m_factor=factor)
    dtype = torch.float16 if _fp16_exact(blocks) else torch.float32
    mins = None if blocks.min is None else _by_block(blocks.min.to(dtype))
    scales = _by_block(blocks.scale.to(dtype))
    return PackedMatrix(weights, scales, mins, n, k, blocks.bits, blocks.group, qtypes, values=values)


def pack_by_rows(blocks_of: Callable[[int, int], QuantBlocks], n: int) -> PackedMatrix:
    """pack() of an n-row matrix whose blocks are read PACK_ROWS rows at a time (`blocks_of(start, stop)`): the same
    tensors, without the whole matrix decoded at once (a Llama-3.2-1B head's Q6_K as int16 q is 525 MB, where
    packed it is 215). Every slice must pack to one format, as a file's type does."""
    whole = None
    for start in range(0, n, PACK_ROWS):
        part = pack(blocks_of(start, min(start + PACK_ROWS, n)))
        if whole is None:
            empty = {name: _rows_like(getattr(part, name), n // BLOCK_N) for name in PACKED_FIELDS}
            whole = replace(part, n=n, **empty)
        if _layout(part) != _layout(whole):
            raise ValueError(f"rows from {start} of a {part.qtypes[0]} matrix pack to another format")
        for name in PACKED_FIELDS:
            if getattr(part, name) is not None:
                getattr(whole, name)[start // BLOCK_N : start // BLOCK_N + part.n // BLOCK_N] = getattr(part, name)
    return whole


def _rows_like(tensor: torch.Tensor | None, blocks: int) -> torch.Tensor | None:
    return None if tensor is None else torch.empty((blocks, *tensor.shape[1:]), dtype=tensor.dtype)


def _layout(matrix: PackedMatrix) -> tuple:
    shapes = tuple(None if (t := getattr(matrix, name)) is None else (t.shape[1:], t.dtype) for name in PACKED_FIELDS)
    table = None if matrix.values is None else tuple(matrix.values.tolist())
    return matrix.k, matrix.bits, matrix.group, matrix.m_factor, shapes, table


def _weights(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [N, K] as the kernel stores it for `bits`: [N/16, K/32, ...] (see _pairs, _nibbles, _high_bits, _crumbs)."""
    q = q.to(torch.int32)
    if bits == 8:
        return _pairs(q).to(torch.int8).contiguous()
    if bits == 6:  # signed -32..31, stored as q + 32
        return torch.cat((_nibbles((q + 32) & 0x0F), _crumbs((q + 32) >> 4)), dim=2).contiguous()
    weights = _nibbles(q & 0x0F)
    return torch.cat((weights, _high_bits(q >> 4)), dim=2).contiguous() if bits == 5 else weights


def _min_factor(blocks: QuantBlocks) -> int:
    """-2^(bits-1) where every min is exactly that times its fp16 scale (Q4_0: -8, Q5_0: -16), else 0."""
    if blocks.bits not in (4, 5) or blocks.min is None or blocks.super is not None:
        return 0
    factor = -(1 << (blocks.bits - 1))
    scale = blocks.scale
    fp16 = torch.equal(scale.half().float(), scale)
    return factor if fp16 and torch.equal(blocks.min, scale * factor) else 0


def _fp16_exact(blocks: QuantBlocks) -> bool:
    values = [blocks.scale] if blocks.min is None else [blocks.scale, blocks.min]
    return all(torch.equal(v.to(torch.float16).float(), v) for v in values)


def _pairs(q: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/32, 16, 16, 2]: in each group, pair p of the block's 16 rows side by side."""
    n, k = q.shape
    return q.reshape(n // BLOCK_N, BLOCK_N, k // GROUP, GROUP // 2, 2).permute(0, 2, 3, 1, 4)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] of 0..15 -> [N/16, K/32, 4, 16, 2] int16: word (row, e) of vector j holds pairs 4j..4j+3's values e."""
    pairs = _pairs(q)  # [N/16, G, p, row, e]
    s = pairs.shape
    pairs = pairs.reshape(s[0], s[1], 4, 4, s[3], 2)  # [.., j, s, row, e]
    words = sum(pairs[:, :, :, shift] << (4 * shift) for shift in range(4))
    return _as_int16(words)


def _high_bits(bit: torch.Tensor) -> torch.Tensor:
    """[N, K] of 0..1 -> [N/16, K/32, 1, 16, 2] int16: bit p of word (row, e) is pair p's value e's."""
    pairs = _pairs(bit)  # [.., p, row, e]
    words = sum(pairs[:, :, p] << p for p in range(GROUP // 2))
    return _as_int16(words).unsqueeze(2)


def _crumbs(high: torch.Tensor) -> torch.Tensor:
    """[N, K] of 0..3 -> [N/16, K/32, 2, 16, 2] int16: bits 2c, 2c + 1 of vector h's word (row, e) are pair 8h + c's value e's."""
    pairs = _pairs(high)  # [.., p, row, e]
    halves = [sum(pairs[:, :, 8 * h + c] << (2 * c) for c in range(8)) for h in range(2)]
    return _as_int16(torch.stack(halves, dim=2))


def _as_int16(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16).contiguous()


def _by_block(per_row: torch.Tensor) -> torch.Tensor:
    """[N, G] -> [N/16, G, 16]: a group's values for 16 output rows side by side."""
    n = per_row.shape[0]
    return per_row.reshape(n // BLOCK_N, BLOCK_N, -1).transpose(1, 2).contiguous()


def pack_parts(parts: list[QuantBlocks]) -> list[PackedMatrix]:
    """A fused matrix's parts (its output rows in order), adjacent parts of one layout packed as one."""
    runs: list[list[QuantBlocks]] = []
    for blocks in parts:
        if runs and runs[-1][-1].layout() == blocks.layout() and _fp16_exact(runs[-1][-1]) == _fp16_exact(blocks):
            runs[-1].append(blocks)
        else:
            runs.append([blocks])
    packed = []
    for run in runs:
        matrix = pack(QuantBlocks.cat(run))
        matrix.qtypes = tuple(dict.fromkeys(blocks.qtype for blocks in run))
        packed.append(matrix)
    return packed


def matrix(parts: list[PackedMatrix], keep: list) -> QuantMatrix:
    """The struct of a matrix made of `parts`; every tensor and struct it points into is appended to `keep`."""
    structs = []
    for part in parts:
        keep.extend(part.tensors())
        structs.append(
            QuantMatrix(
                weights=part.weights.data_ptr(),
                scales=part.scales.data_ptr(),
                mins=None if part.mins is None else part.mins.data_ptr(),
                super_scales=None if part.super_scales is None else part.super_scales.data_ptr(),
                super_mins=None if part.super_mins is None else part.super_mins.data_ptr(),
                n=part.n,
                k=part.k,
                bits=part.bits,
                scale_bytes=part.scale_bytes,
                group=part.group,
                m_factor=part.m_factor,
                values=None if part.values is None else part.values.data_ptr(),
            )
        )
    for this, following in zip(structs, structs[1:]):
        this.next = ctypes.pointer(following)
    keep.extend(structs)
    return structs[0]


FLOAT_TYPES = {None, "F32", "F16", "BF16"}  # float weights: the native step quantizes them to int4 itself
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS")


class NoNativeKernel(ValueError):
    """A tensor of a quantized type the native kernels do not read (Q2_K, IQ3_S, ...): the model runs on torch."""


def kernel_refusal(name: str, source: TensorSource) -> str | None:
    """Why the native linears cannot take this tensor as the file holds it (a quantized type with no kernel:
    re-quantizing it would lose what the file's author kept), naming it; None when they can. It reads no
    data, so the selector asks it before anything is packed (worker/runtime/native_step.py's `unsupported`)."""
    if source.qtype in FLOAT_TYPES or source.qtype in NATIVE_TYPES:
        return None
    return _no_kernel(name, source.qtype)


def native_blocks(name: str, source: TensorSource) -> QuantBlocks:
    """A tensor as the native step's linears take it: the file's own blocks as they are, or lmq's int4 of its floats.

    A quantized type with no kernel raises NoNativeKernel, naming the tensor, rather than being re-quantized.
    """
    blocks = source.blocks()
    if blocks is not None:
        return blocks
    if source.qtype not in FLOAT_TYPES:
        raise NoNativeKernel(_no_kernel(name, source.qtype))
    return QuantBlocks.from_int4(quantize_int4(source.load()))


def _no_kernel(name: str, qtype: str | None) -> str:
    return f"{name} is {qtype}, a type with no native kernel (those: {', '.join(NATIVE_TYPES)})"
