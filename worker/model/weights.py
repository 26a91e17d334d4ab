"""Where a model's tensors come from: loaders hand the builder a mapping of HF-style names to sources."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

INT4_GROUP = 32


@dataclass
class Int4Blocks:
    """4-bit weights in groups of INT4_GROUP along the input dim: value = (q - 8) * scale + zero."""

    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K // INT4_GROUP] float32
    zero: torch.Tensor  # [N, K // INT4_GROUP] float32

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        groups = (self.q.float() - 8).view(n, k // INT4_GROUP, INT4_GROUP)
        return (groups * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def rows(self, index: torch.Tensor) -> Int4Blocks:
        return Int4Blocks(self.q[index], self.scale[index], self.zero[index])

    @staticmethod
    def cat(parts: list[Int4Blocks]) -> Int4Blocks:
        return Int4Blocks(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), torch.cat([p.zero for p in parts])
        )


@dataclass
class TensorSource:
    """A tensor loaded on demand: `load()` gives float32 in HF layout; `int4()` the file's own 4-bit blocks, if any."""

    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]
    int4: Callable[[], Int4Blocks | None] = lambda: None


WeightMap = dict[str, TensorSource]
