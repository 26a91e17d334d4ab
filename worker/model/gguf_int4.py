"""GGUF 4-bit blocks (Q4_0, Q4_1, Q4_K) as Int4Blocks, without a round trip through float.

Every format stores 32-value groups as value = a * q + b with q in 0..15, which is the int4 kernel's
(q - 8) * scale + zero with scale = a and zero = b + 8a.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K

from worker.model.weights import Int4Blocks


def _halves(f16_bytes: np.ndarray) -> np.ndarray:
    return f16_bytes.copy().view(np.float16).astype(np.float32)


def _nibbles_low_then_high(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] values: the low nibbles are values 0..15, the high ones 16..31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _halves(blocks[:, 0:2])[:, 0]
    return _nibbles_low_then_high(blocks[:, 2:]), d, np.zeros_like(d)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m = _halves(blocks[:, 0:2])[:, 0], _halves(blocks[:, 2:4])[:, 0]
    return _nibbles_low_then_high(blocks[:, 4:]), d, m + 8 * d


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = blocks.shape[0]
    d, dmin = _halves(blocks[:, 0:2]), _halves(blocks[:, 2:4])
    sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scale = (d * sc.astype(np.float32)).reshape(-1)
    offset = (dmin * mins.astype(np.float32)).reshape(-1)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n * 8, 32)
    return q, scale, -offset + 8 * scale


_BLOCK_BYTES = {
    GGMLQuantizationType.Q4_0: (18, _q4_0),
    GGMLQuantizationType.Q4_1: (20, _q4_1),
    GGMLQuantizationType.Q4_K: (144, _q4_k),
}


def gguf_int4_blocks(raw: np.ndarray, qtype: GGMLQuantizationType, rows: int, columns: int) -> Int4Blocks | None:
    """raw: the tensor's bytes [rows, bytes per row]; None for formats that are not 4-bit."""
    if qtype not in _BLOCK_BYTES:
        return None
    block_bytes, unpack = _BLOCK_BYTES[qtype]
    q, scale, zero = unpack(np.asarray(raw).reshape(-1, block_bytes))
    return Int4Blocks(
        q=torch.from_numpy(q.reshape(rows, columns).astype(np.uint8)),
        scale=torch.from_numpy(scale.reshape(rows, -1).astype(np.float32)),
        zero=torch.from_numpy(zero.reshape(rows, -1).astype(np.float32)),
    )
