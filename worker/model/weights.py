"""Where a model's tensors come from: loaders hand the builder a mapping of HF-style names to sources."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
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
    # The file's own quantized blocks for the native step's kernels (GGUF Q4_0 ... Q6_K), else None.
    blocks: Callable[[], QuantBlocks | None] = lambda: None
    qtype: str | None = None  # the file's type name (GGUF: "Q5_0", "F32", ...), None where the format has none
    # The file's bytes [rows, bytes a row] where its rows are the tensor's as they are (GGUF: not reordered or shifted).
    file_rows: Callable[[], np.ndarray | None] = lambda: None
    # load()[start:stop] without loading the rest, where the format can (GGUF); None: rows() slices load().
    load_rows: Callable[[int, int], torch.Tensor] | None = None

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """float32 rows [start, stop) of load()'s tensor, the same values."""
        return self.load()[start:stop] if self.load_rows is None else self.load_rows(start, stop)


WeightMap = dict[str, TensorSource]


@dataclass(frozen=True)
class TableRows:
    """A [rows, columns] table read a slice of rows at a time, each slice the values the whole table would hold.

    Why: Int8Linear quantizes an output head a slice at a time, and a whole head is large beside its slices (Gemma
    3's 262,144 x 640: 671 MB in float32 and 335 MB in bfloat16, where 8,192 rows are 21 MB and 10 MB)."""

    shape: tuple[int, int]
    read: Callable[[int, int], torch.Tensor]  # rows [start, stop)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self.read(rows.start, min(rows.stop, self.shape[0]))


@dataclass
class QuantBlocks:
    """Integer weights with a scale and a min per group along the input dim: value = scale * q + min.

    The form every GGUF type the native step reads reduces to, exactly (worker/model/gguf_blocks.py);
    bits says how the native kernel stores q: 4 or 5 (unsigned, with min), 6 or 8 (signed, min None: 0).
    With `values` (a table format: Q3_K, IQ4_NL, IQ4_XS), q holds 4-bit indices and each weight is
    scale * values[q], min None.
    """

    qtype: str  # the file's type ("Q5_0", ...), or "int4" for lmq's own quantization of float weights
    q: torch.Tensor  # [N, K] int16
    scale: torch.Tensor  # [N, K // group] float32
    min: torch.Tensor | None  # [N, K // group] float32, or None
    group: int  # 32, or 16 (Q6_K)
    bits: int
    # K-quants: their own two levels, which the native kernel reads (scale and min above are their products).
    super: SuperScales | None = None
    values: torch.Tensor | None = None  # a table format's 16 int8 values, which q indexes

    def weights(self) -> torch.Tensor:
        """q as integer weights: the table's values where q indexes one."""
        return self.q if self.values is None else self.values.to(torch.int16)[self.q.long()]

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        groups = self.weights().float().view(n, k // self.group, self.group) * self.scale[..., None]
        return (groups if self.min is None else groups + self.min[..., None]).view(n, k)

    def rows(self, index: torch.Tensor) -> QuantBlocks:
        low = None if self.min is None else self.min[index]
        levels = None if self.super is None else self.super.rows(index)
        q, scale = self.q[index], self.scale[index]
        return QuantBlocks(self.qtype, q, scale, low, self.group, self.bits, levels, self.values)

    def int4(self) -> Int4Blocks | None:
        """The same weights as Int4Blocks (scale, zero = min + 8 scale), where they are 4-bit groups of INT4_GROUP."""
        if self.bits != 4 or self.group != INT4_GROUP or self.values is not None:
            return None
        return Int4Blocks(self.q.to(torch.uint8), self.scale, self.min + 8 * self.scale)

    @staticmethod
    def from_int4(blocks: Int4Blocks) -> QuantBlocks:
        """lmq's own int4 (quantize_int4 of float weights), its scales and mins rounded to fp16 as the native step always kept them."""
        scale, low = blocks.scale.half().float(), (blocks.zero - 8 * blocks.scale).half().float()
        return QuantBlocks("int4", blocks.q.to(torch.int16), scale, low, INT4_GROUP, 4)

    @staticmethod
    def cat(parts: list[QuantBlocks]) -> QuantBlocks:
        first = parts[0]
        if any(p.layout() != first.layout() for p in parts):
            raise ValueError("QuantBlocks.cat: the parts differ in layout")
        low = None if first.min is None else torch.cat([p.min for p in parts])
        levels = None if first.super is None else SuperScales.cat([p.super for p in parts])
        qtype = "+".join(dict.fromkeys(p.qtype for p in parts))
        q, scale = torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts])
        return QuantBlocks(qtype, q, scale, low, first.group, first.bits, levels, first.values)

    def layout(self) -> tuple:
        """What decides the native kernel's layout: parts alike in it can be one matrix."""
        table = None if self.values is None else tuple(self.values.tolist())
        return self.bits, self.group, self.min is None, self.super is None, table


@dataclass
class SuperScales:
    """A K-quant's scales as the file holds them: scale = d * sc, min = -(dmin * mn), d per 256 values."""

    sc: torch.Tensor  # [N, K // group] int16 (Q4_K/Q5_K: 0..63; Q6_K: -128..127)
    mn: torch.Tensor | None  # [N, K // group] int16 0..63, or None (Q6_K)
    d: torch.Tensor  # [N, K // 256] float32 (fp16 values)
    dmin: torch.Tensor | None

    def rows(self, index: torch.Tensor) -> SuperScales:
        return SuperScales(*(None if t is None else t[index] for t in (self.sc, self.mn, self.d, self.dmin)))

    @staticmethod
    def cat(parts: list[SuperScales]) -> SuperScales:
        columns = zip(*((p.sc, p.mn, p.d, p.dmin) for p in parts))
        return SuperScales(*(None if column[0] is None else torch.cat(column) for column in columns))
