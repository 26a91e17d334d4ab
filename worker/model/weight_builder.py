"""WeightBuilder: the linears, norms' tensors and output head a family's `build` asks for, in the chosen dtype and weight mode."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm import tqdm

from worker.model.config import ModelConfig
from worker.model.embedding import TokenEmbedding
from worker.model.lazy_linear import LazyLinear
from worker.model.quant_linear import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    TieredLinear,
    dense_linear,
    int4_supported,
    quantize_int4,
)
from worker.model.weights import Int4Blocks, TableRows, TensorSource, WeightMap


class WeightBuilder:
    """dense_from_rows: with int8/int4, also keep a packed dense copy of every linear for inputs of that many rows or more
    (TieredLinear); None: one set of weights per linear. head_int8_below: run the output head on int8 weights for
    inputs of fewer rows than this, and on packed dense ones (the same results as F.linear) from there on. lazy: every
    linear (the head's tiers too) a LazyLinear and the token embedding unbuilt, each built on first use
    (worker/model/lazy_linear.py, worker/model/embedding.py: where the native step serves the model, it reads
    its own copies from the checkpoint instead)."""

    def __init__(
        self,
        weights: WeightMap,
        dtype: torch.dtype,
        quant: str,
        device: torch.device,
        name: str = "",
        dense_from_rows: int | None = None,
        head_int8_below: int | None = None,
        lazy: bool = False,
    ) -> None:
        self.weights, self.dtype, self.quant, self.device, self.name = weights, dtype, quant, device, name
        self.lazy = lazy
        self.dense_from_rows = dense_from_rows if quant in ("int8", "int4") else None
        self.head_int8_below = head_int8_below if quant in ("int8", "int4") else None

    def _require(self, names: list[str]) -> None:
        missing = [name for name in names if name not in self.weights]
        if missing:
            raise ValueError(f"{self.name or 'checkpoint'}: tensor {missing[0]!r} is missing")

    def _built(self, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """build() now, or where lazy a LazyLinear that calls it on first use."""
        return LazyLinear(build) if self.lazy else build()

    def tensor(self, name: str) -> torch.Tensor:
        self._require([name])
        return self.weights[name].load().to(device=self.device, dtype=self.dtype)

    def embedding(self, name: str) -> TokenEmbedding:
        """The token embedding table `name`, unbuilt where lazy (worker/model/embedding.py)."""
        self._require([name])
        return TokenEmbedding(lambda: self.tensor(name), self.dtype, lazy=self.lazy)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.tensor(name) if name in self.weights else None

    def layer_range(self, config: ModelConfig) -> range:
        # disable=None: a progress bar only on a terminal, never `\r` lines in a log file
        return tqdm(range(config.num_layers), desc=f"loading {self.name}", unit="layer", disable=None)

    def linear(self, names: list[str], bias_names: list[str] | None = None) -> torch.nn.Module:
        """One linear over the concatenated output rows of `names` (fuses q/k/v and gate/up)."""
        self._require(names)
        return self._built(lambda: self._linear(names, bias_names))

    def _linear(self, names: list[str], bias_names: list[str] | None) -> torch.nn.Module:
        sources = [self.weights[name] for name in names]
        bias = self._bias(bias_names)
        shape = (sum(source.shape[0] for source in sources), sources[0].shape[1])
        if self.quant == "int4" and int4_supported(shape, self.device):
            return self._int4(sources, bias)
        weight = torch.cat([source.load() for source in sources])
        if self.quant in ("int8", "int4"):
            return self._tiered(Int8Linear(weight, bias, self.dtype).to(self.device), lambda: weight, bias)
        return DenseLinear(weight.to(device=self.device, dtype=self.dtype), bias)

    def head(self, name: str, table: Callable[[], torch.Tensor] | None = None) -> torch.nn.Module:
        """The output head over the table `name` [vocab, hidden] (often the embeddings themselves); `table()`: the
        whole table where it may be built already (a TokenEmbedding's). Lazy: each tier built on first use (the
        native step reads the int8 one where the file's head is not in blocks it reads), the int8 one from the
        file a slice of rows at a time, never the whole table at once."""
        self._require([name])
        whole = table or (lambda: self.tensor(name))
        loaded = None if self.lazy else whole()  # built now: one load for both tiers

        def weight() -> torch.Tensor:
            return whole() if loaded is None else loaded

        if self.head_int8_below is None:
            return self._built(lambda: DenseLinear(weight(), None))
        rows = self.table_rows(name) if loaded is None else loaded
        small = self._built(lambda: Int8Linear(rows, None, self.dtype).to(self.device))
        dense = self._built(lambda: dense_linear(weight().to(self.dtype), None))
        return TieredLinear(small, dense, self.head_int8_below)

    def table_rows(self, name: str) -> TableRows:
        """The tensor `name` read by rows, each row as tensor(name) would hold it."""
        source = self.weights[name]
        return TableRows(source.shape, lambda start, stop: source.rows(start, stop).to(self.device, self.dtype))

    def _int4(self, sources: list[TensorSource], bias: torch.Tensor | None) -> torch.nn.Module:
        """A file's own 4-bit blocks as they are, any other matrix quantized to int4; the dense copy (long prompts)
        holds the checkpoint's own values, not that re-quantization of a Q5_0, Q6_K or Q8_0 matrix (the native
        step reads the same file's blocks as they are). Each matrix is unpacked once: its file's blocks
        dequantize exactly (bit for bit gguf's dequantizer, in about half its time)."""
        stored = [source.blocks() for source in sources]  # None: a float tensor
        int4 = [None if found is None else found.int4() for found in stored]  # None: not 4-bit groups of 32
        values = [  # kept only for the matrices quantized here
            (source.load() if found is None else found.dequantize()) if four is None else None
            for source, found, four in zip(sources, stored, int4)
        ]
        blocks = Int4Blocks.cat([quantize_int4(value) if four is None else four for four, value in zip(int4, values)])

        def own_values() -> torch.Tensor:
            return torch.cat([found.dequantize() if value is None else value for found, value in zip(stored, values)])

        return self._tiered(Int4Linear(blocks, bias, self.dtype), own_values, bias)

    def _tiered(self, small: torch.nn.Module, dense_weight, bias: torch.Tensor | None) -> torch.nn.Module:
        if self.dense_from_rows is None:
            return small
        dense = dense_linear(
            dense_weight().to(device=self.device, dtype=self.dtype), None if bias is None else bias.to(self.dtype)
        )
        return TieredLinear(small, dense, self.dense_from_rows)

    def _bias(self, names: list[str] | None) -> torch.Tensor | None:
        if not names or names[0] not in self.weights:
            return None
        return torch.cat([self.tensor(name) for name in names])
