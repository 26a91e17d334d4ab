"""A GGUF tensor's rows dequantized by the native library (worker/native/gguf_rows.h), the way the native step
reads the token embedding from its file's blocks: every type, bit for bit gguf.quants' float32 values."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from tests.support.gguf_blocks import raw_tensor
from worker.model.gguf_blocks import FORMATS
from worker.native import build

pytestmark = pytest.mark.skipif(
    build.missing_requirements() is not None, reason=f"native: {build.missing_requirements()}"
)


def native_rows(qtype: int, raw: np.ndarray, k: int, rows: list[int]) -> tuple[int, np.ndarray]:
    library = build.load()
    library.lmq_gguf_rows.restype = ctypes.c_int
    raw = np.ascontiguousarray(raw)
    index = np.array(rows, dtype=np.int64)
    out = np.full((len(rows), k), np.nan, dtype=np.float32)
    status = library.lmq_gguf_rows(
        ctypes.c_int64(qtype), raw.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(raw.shape[1]), ctypes.c_int64(k),
        index.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(len(rows)), out.ctypes.data_as(ctypes.c_void_p),
    )  # fmt: skip
    return status, out


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda qtype: qtype.name)
def test_every_type_s_rows_are_gguf_s_values_bit_for_bit(qtype: QType) -> None:
    rows, k = 24, 512
    raw = raw_tensor(qtype, rows, k, seed=int(qtype))
    expected = dequantize(raw, qtype).reshape(rows, k)
    picked = [7, 0, 23, 7, 12]
    status, out = native_rows(int(qtype), raw, k, picked)
    assert status == 0
    assert np.array_equal(out.view(np.uint32), expected[picked].view(np.uint32))


def test_a_type_it_does_not_read_or_a_row_shorter_than_its_blocks_is_refused() -> None:
    raw = raw_tensor(QType.Q8_0, 2, 64)
    assert native_rows(int(QType.F16), raw, 64, [0])[0] == 1
    assert native_rows(int(QType.Q2_K), raw, 64, [0])[0] == 1
    assert native_rows(int(QType.Q8_0), raw[:, :34], 64, [0])[0] == 1
    assert native_rows(int(QType.Q4_K), raw_tensor(QType.Q4_K, 2, 256), 96, [0])[0] == 1  # not whole super-blocks


@pytest.mark.parametrize("qtype", [*FORMATS, QType.Q2_K, QType.F16], ids=lambda qtype: qtype.name)
def test_the_loader_dequantizes_the_native_types_natively_and_every_type_to_gguf_s_values(
    qtype: QType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.model import gguf_metadata

    raw = raw_tensor(qtype, 24, 512, seed=5)
    expected = dequantize(raw, qtype).reshape(24, 512).astype(np.float32)
    if qtype in FORMATS:  # served by the native rows: gguf's numpy dequantizer is not called
        monkeypatch.setattr(gguf_metadata, "dequantize", lambda *_: pytest.fail("gguf's dequantizer was called"))
    values = gguf_metadata.dequantized(raw, qtype, (24, 512)).numpy()
    assert np.array_equal(values.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", [*FORMATS, QType.Q2_K, QType.F16], ids=lambda qtype: qtype.name)
@pytest.mark.parametrize("shift", [0.0, 1.0], ids=["as stored", "shifted"])
def test_a_slice_of_a_tensor_s_rows_is_those_rows_of_the_whole_tensor(qtype: QType, shift: float) -> None:
    """TensorSource.rows: what an output head's int8 tier is quantized from a slice at a time, never the whole
    table; a tensor whose rows the loader reorders (llama's q/k) slices the whole one."""
    import torch

    from worker.model.gguf_loader import _source

    raw = raw_tensor(qtype, 24, 512, seed=6)
    for order in (None, torch.randperm(24, generator=torch.Generator().manual_seed(0))):
        source = _source(raw, qtype, (24, 512), order, shift)
        whole = source.load()
        for start, stop in ((0, 8), (8, 24), (20, 40)):
            assert torch.equal(source.rows(start, stop), whole[start:stop])
