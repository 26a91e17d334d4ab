"""TokenEmbedding: the model's token embedding table, built the first time something reads it.

Why: on a CPU the native step reads the embedding from its file's own blocks, a row a token (the tied head's
packed copy, or a copy of the embedding's: Q8_0 at 1.06 bytes a value, Q6_K at 0.82; `embedding_form` in
worker/runtime/native_step.py), so a bfloat16 copy of the whole table (2 bytes a value: Gemma 3 270M's is
320 MiB, a real Llama-3.2-1B's 500 MiB) is memory no step reads. Where the native step may serve the model
the loader leaves the table unbuilt (WeightBuilder's lazy mode); whatever reads `weight` (a torch forward,
the native step on a type it does not dequantize) builds it then: the values the loader would have built.

A build runs where the forward runs (the engine's compute thread); nothing else calls it concurrently.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class TokenEmbedding(torch.nn.Module):
    def __init__(self, load: Callable[[], torch.Tensor], dtype: torch.dtype, *, lazy: bool) -> None:
        super().__init__()
        self._load = load
        self.dtype = dtype  # the table's, built or not
        self._weight: torch.Tensor | None = None if lazy else load()

    @property
    def built(self) -> bool:
        return self._weight is not None

    @property
    def weight(self) -> torch.Tensor:
        """The table [vocab, hidden], built (and kept) on first use."""
        self.build()
        return self._weight

    def build(self) -> int:
        """Build the table now (a backend that runs torch steps, rather than its first step); 1 if it was not built."""
        if self._weight is not None:
            return 0
        self._weight = self._load()
        return 1

    def table(self) -> torch.Tensor:
        """The table without keeping it where it is not built (a tied head's build reads it once)."""
        return self._load() if self._weight is None else self._weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids.to(self.weight.device), self.weight)


def build_tables(model: torch.nn.Module) -> int:
    """Build every TokenEmbedding of `model` not built yet (a model of its own, a stub's, has none); how many."""
    return sum(module.build() for module in model.modules() if isinstance(module, TokenEmbedding))
