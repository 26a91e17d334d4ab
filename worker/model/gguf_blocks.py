"""GGUF block types as QuantBlocks (value = scale * q + min per group), exactly as the file holds them.

Every type the native step has a kernel for reduces to integer q with one float32 scale and min per
group once its super-block scales are multiplied out; the products are exact in float32 (an fp16 d
times a 6- or 8-bit integer scale), so nothing is lost beyond the file's own quantization:
  Q4_0  q 0..15, a = d, m = -8d            Q4_1  q 0..15, a = d, m
  Q5_0  q 0..31, a = d, m = -16d           Q5_1  q 0..31, a = d, m
  Q8_0  q -128..127 (signed), a = d         Q4_K  q 0..15, a = d sc, m = -dmin mn (groups of 32)
  Q5_K  q 0..31, a = d sc, m = -dmin mn     Q6_K  q - 32 in -32..31 (signed, 6 bits), a = d sc, groups of 16
Three more are table formats: q is a 4-bit index into 16 values (QuantBlocks.values, `TABLES`), no min:
  Q3_K    index q + 4 of -4..3, a = d (sc - 32), groups of 16 (4.56 bits a weight in the kernel's layout
          against the file's 3.44: the third bit plane becomes a nibble's)
  IQ4_NL  index into ggml's 16 int8 values (-127..113), a = d          IQ4_XS  the same, a = d (sc - 32)
The layouts follow ggml's (ggml-quants.c) and gguf.quants' dequantizers, which the tests compare with.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import IQ4_NL, Q4_K

from worker.model.weights import Int4Blocks, QuantBlocks, SuperScales


def _f16(column: np.ndarray) -> np.ndarray:
    """[blocks, 2] bytes -> [blocks, 1] float32."""
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _low_then_high(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32]: the low nibbles are values 0..15, the high ones 16..31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _bits_of(words: np.ndarray, count: int) -> np.ndarray:
    """[blocks, 4] bytes of a little-endian uint32 -> [blocks, count] of its bits 0..count-1."""
    value = np.ascontiguousarray(words).view(np.uint32)
    return ((value >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    return _low_then_high(b[:, 2:18]), d, -8 * d


def _q4_1(b: np.ndarray):
    return _low_then_high(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    return _low_then_high(b[:, 6:22]) | (_bits_of(b[:, 2:6], 32) << 4), d, -16 * d


def _q5_1(b: np.ndarray):
    return _low_then_high(b[:, 8:24]) | (_bits_of(b[:, 4:8], 32) << 4), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray):
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8), _f16(b[:, 0:2]), None


def _k_scales(b: np.ndarray):
    """Q4_K / Q5_K super-block scales: (a, m) [blocks, 8] float32 for its 8 groups of 32, and their levels."""
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), (sc, mn, d, dmin)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 128] bytes -> [blocks, 8, 32]: chunk c's 32 bytes hold group 2c (low nibbles) and 2c + 1 (high)."""
    n = qs.shape[0]
    return np.stack((qs.reshape(n, 4, 32) & 0x0F, qs.reshape(n, 4, 32) >> 4), axis=2).reshape(n, 8, 32)


def _q4_k(b: np.ndarray):
    a, m, levels = _k_scales(b)
    return _k_nibbles(b[:, 16:144]), a, m, levels


def _q5_k(b: np.ndarray):
    a, m, levels = _k_scales(b)
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # bit g: group g's
    return _k_nibbles(b[:, 48:176]) | (high << 4), a, m, levels


def _q6_k(b: np.ndarray):
    n = b.shape[0]
    ql, qh = b[:, 0:128].reshape(n, 2, 2, 32), b[:, 128:192].reshape(n, 2, 1, 32)
    # Each half of 128 values: groups of 32 are ql[0] low, ql[1] low, ql[0] high, ql[1] high nibbles, with qh's bit pairs 0..3.
    low = np.stack((ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4), axis=2)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).astype(np.int16) - 32
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
    d = _f16(b[:, 208:210])
    return q.reshape(n, 256), d * sc.astype(np.float32), None, (sc, None, d, None)


def _q3_k(b: np.ndarray):
    n = b.shape[0]
    hmask, qs, packed, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    # 16 six-bit scales: low nibbles from bytes 0-7 (scales 0-7, then 8-15 from the high nibbles), top bit pairs from bytes 8-11.
    low = (packed[:, 0:8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)) & 0x0F
    high = (packed[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)) & 3
    sc = (low.reshape(n, 16) | (high.reshape(n, 16) << 4)).astype(np.int8) - 32
    # Value v is its bit pair, (v % 128) // 32 of qs byte 32 (v // 128) + v % 32, less 4 where its third bit, v // 32
    # of hmask byte v % 32, is clear: q + 4 (the index) is the bit pair plus 4 times the third bit.
    pairs = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    third = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return pairs.reshape(n, 256) + 4 * third.reshape(n, 256), d * sc.astype(np.float32), None, (sc, None, d, None)


def _iq4_indices(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16 k] index bytes -> [blocks, 32 k]: each 32 values are 16 bytes' low nibbles, then their high ones."""
    n = qs.shape[0]
    return _low_then_high(qs.reshape(n, -1, 16)).reshape(n, -1)


def _iq4_nl(b: np.ndarray):
    return _iq4_indices(b[:, 2:18]), _f16(b[:, 0:2]), None


def _iq4_xs(b: np.ndarray):
    n = b.shape[0]
    d, high = _f16(b[:, 0:2]), np.ascontiguousarray(b[:, 2:4]).view(np.uint16)
    low = (b[:, 4:8].reshape(n, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)) & 0x0F
    top = (high >> np.arange(0, 16, 2, dtype=np.uint16).reshape(1, 8)) & 3
    sc = (low.reshape(n, 8) | (top.astype(np.uint8) << 4)).astype(np.int8) - 32
    return _iq4_indices(b[:, 8:136]), d * sc.astype(np.float32), None, (sc, None, d, None)


# type: (bytes per block, values per block, group, bits, unpack)
FORMATS = {
    QType.Q4_0: (18, 32, 32, 4, _q4_0),
    QType.Q4_1: (20, 32, 32, 4, _q4_1),
    QType.Q5_0: (22, 32, 32, 5, _q5_0),
    QType.Q5_1: (24, 32, 32, 5, _q5_1),
    QType.Q8_0: (34, 32, 32, 8, _q8_0),
    QType.Q4_K: (144, 256, 32, 4, _q4_k),
    QType.Q5_K: (176, 256, 32, 5, _q5_k),
    QType.Q6_K: (210, 256, 16, 6, _q6_k),
    QType.Q3_K: (110, 256, 16, 4, _q3_k),
    QType.IQ4_NL: (18, 32, 32, 4, _iq4_nl),
    QType.IQ4_XS: (136, 256, 32, 4, _iq4_xs),
}
IQ4_VALUES = tuple(IQ4_NL.kvalues)  # ggml's kvalues_iq4nl
TABLES = {QType.Q3_K: tuple(range(-4, 4)) + (0,) * 8, QType.IQ4_NL: IQ4_VALUES, QType.IQ4_XS: IQ4_VALUES}


def gguf_blocks(raw: np.ndarray, qtype: QType, rows: int, columns: int) -> QuantBlocks | None:
    """raw: a 2-D tensor's bytes [rows, bytes per row]; None for a type with no native kernel (float types among them)."""
    if qtype not in FORMATS:
        return None
    block_bytes, _, group, bits, unpack = FORMATS[qtype]
    q, scale, offset, *levels = unpack(np.asarray(raw, dtype=np.uint8).reshape(-1, block_bytes))
    return QuantBlocks(
        qtype=qtype.name,
        q=torch.from_numpy(np.ascontiguousarray(q).reshape(rows, columns).astype(np.int16)),
        scale=torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, columns // group)),
        min=None
        if offset is None
        else torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32).reshape(rows, columns // group)),
        group=group,
        bits=bits,
        super=_super_scales(levels[0], rows, columns, group) if levels else None,
        values=torch.tensor(TABLES[qtype], dtype=torch.int8) if qtype in TABLES else None,
    )


def _super_scales(levels: tuple, rows: int, columns: int, group: int) -> SuperScales:
    sc, mn, d, dmin = levels

    def per_row(values: np.ndarray | None, size: int, dtype: type) -> torch.Tensor | None:
        if values is None:
            return None
        return torch.from_numpy(np.ascontiguousarray(values).reshape(rows, columns // size).astype(dtype))

    return SuperScales(
        per_row(sc, group, np.int16),
        per_row(mn, group, np.int16),
        per_row(d, 256, np.float32),
        per_row(dmin, 256, np.float32),
    )


def gguf_int4_blocks(raw: np.ndarray, qtype: QType, rows: int, columns: int) -> Int4Blocks | None:
    """The torch path's int4 kernel's form of a 4-bit type (Q4_0, Q4_1, Q4_K); None for the others."""
    blocks = gguf_blocks(raw, qtype, rows, columns)
    return None if blocks is None else blocks.int4()
