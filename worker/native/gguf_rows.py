"""A GGUF tensor's rows dequantized by the native library (worker/native/gguf_rows.h), for the loader.

The same float32 values as gguf.quants' numpy dequantizer, bit for bit (tests/worker/model/test_gguf_rows.py),
in a fraction of its time: Gemma 3's 262,144 x 640 Q8_0 embedding took 1.2 s through numpy. Only where the
library is built for this CPU and reads the type (the native kernels' types); the caller falls back otherwise.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from worker.native import build


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Asked once a process: the check reads /proc/cpuinfo and hashes the sources (0.6 ms, and a load reads
    hundreds of tensors)."""
    return build.load() if build.missing_requirements() is None else None


def dequantize_into(raw: np.ndarray, ggml_type: int, out: np.ndarray) -> bool:
    """raw: [rows, bytes a row] uint8 blocks; out: [rows, values a row] float32, filled. False: nothing was done."""
    if raw.dtype != np.uint8 or raw.ndim != 2:
        return False
    if not (
        raw.flags.c_contiguous and out.flags.c_contiguous and out.dtype == np.float32 and out.shape[0] == raw.shape[0]
    ):
        return False
    library = _library()
    if library is None:
        return False
    rows = np.arange(raw.shape[0], dtype=np.int64)
    status = library.lmq_gguf_rows(
        ctypes.c_int64(ggml_type), ctypes.c_void_p(raw.ctypes.data), ctypes.c_int64(raw.shape[1]),
        ctypes.c_int64(out.shape[1]), ctypes.c_void_p(rows.ctypes.data), ctypes.c_int64(len(rows)),
        ctypes.c_void_p(out.ctypes.data),
    )  # fmt: skip
    return status == 0
