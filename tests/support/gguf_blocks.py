"""Tensors of each GGUF block type as files hold them, for tests of the loaders and kernels that read them."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize

# gguf.quants has no quantizer for the K-quants and the IQ4s: their blocks are random bytes with these fp16
# scales (byte offset, largest value) set to modest values; their other scale bits (6-bit sc, int8 sc) random.
K_QUANT_SCALES = {
    QType.Q2_K: ((80, 1e-3), (82, 1e-3)),  # no native kernel: for refusals
    QType.Q3_K: ((108, 1e-3),),
    QType.IQ4_NL: ((0, 4e-4),),
    QType.IQ4_XS: ((0, 2e-5),),
    QType.Q4_K: ((0, 2e-3), (2, 2e-3)),
    QType.Q5_K: ((0, 1e-3), (2, 1e-3)),
    QType.Q6_K: ((208, 2e-4),),
}


def raw_tensor(qtype: QType, rows: int, columns: int, seed: int = 0, size: float = 1.0) -> np.ndarray:
    """A [rows, columns] tensor of `qtype`, [rows, bytes per row] uint8; size scales its values (roughly)."""
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANT_SCALES:
        weights = rng.standard_normal((rows, columns)).astype(np.float32) * 0.05 * size
        return quantize(weights, qtype) if qtype != QType.F32 else weights
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    count = rows * columns // block_values
    blocks = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    for offset, largest in K_QUANT_SCALES[qtype]:
        scales = (rng.uniform(0.2, 1.0, count) * largest * size).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(count, 2)
    return blocks.reshape(rows, -1)
