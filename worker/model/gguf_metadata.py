"""Reading a GGUF file's metadata and small tensors, for the families' config readers."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from worker.native.gguf_rows import dequantize_into

DEQUANTIZE_ROWS = 4096  # rows of a tensor dequantized at a time


class Metadata:
    """Key/value metadata; `arch_get("x")` reads "<architecture>.x"."""

    def __init__(self, reader: GGUFReader) -> None:
        self.fields = reader.fields
        self.arch = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def arch_int(self, key: str, default: int | None = None) -> int:
        """An integer hyper-parameter; per-layer arrays (OpenELM, Gemma 3n) are refused by name."""
        value = self.arch_get(key, default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {self.arch}.{key}")
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"GGUF {self.arch}.{key} differs per layer ({value[:4]}…): not supported")
            value = value[0]
        return int(value)


def tensor_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """The tensor's shape in PyTorch order (GGUF lists dimensions innermost first)."""
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if len(shape) == 2 and shape[0] == 1 and tensor.data.ndim == 1:
        shape = shape[1:]
    return shape


def dequantized(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values: by the native library where it reads the type (worker/native/gguf_rows.py, the same values),
    else DEQUANTIZE_ROWS of raw's first dimension at a time: gguf's dequantizer makes temporaries of its output's
    size, which for a whole large embedding (Gemma 3's 262144 x 640) set the load's peak memory."""
    out = torch.empty(shape, dtype=torch.float32)
    parts = raw if raw.ndim > 1 else raw[None]
    rows = out.numpy().reshape(parts.shape[0], -1)  # a view: filling it fills out
    if dequantize_into(parts, int(qtype), rows):
        return out
    for start in range(0, parts.shape[0], DEQUANTIZE_ROWS):
        values = dequantize(parts[start : start + DEQUANTIZE_ROWS], qtype)
        rows[start : start + DEQUANTIZE_ROWS] = values.reshape(len(values), -1)
    return out


class GGUFTensors:
    """The file's tensors by GGUF name; small ones (rope factors) load eagerly for the config."""

    def __init__(self, reader: GGUFReader) -> None:
        self.by_name: dict[str, ReaderTensor] = {tensor.name: tensor for tensor in reader.tensors}

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def shape(self, name: str) -> tuple[int, ...]:
        return tensor_shape(self.by_name[name])

    def load(self, name: str) -> torch.Tensor | None:
        tensor = self.by_name.get(name)
        if tensor is None:
            return None
        return dequantized(tensor.data, GGMLQuantizationType(tensor.tensor_type), tensor_shape(tensor))

    def factors(self, name: str) -> tuple[float, ...]:
        values = self.load(name)
        return () if values is None else tuple(float(x) for x in values.flatten())
