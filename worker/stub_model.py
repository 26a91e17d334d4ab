"""A model that answers at once, for benchmarks that measure the queue and not the math.

`stub_model(loaded)` keeps the loaded model's tokenizer, chat template and config (so prompts,
KV pages and detokenization behave as usual) and swaps the transformer for one that returns,
without computing anything, logits that always pick the same ordinary token.
"""

from __future__ import annotations

import dataclasses

import torch

from worker.batch import PagedKV, StepBatch
from worker.model.loader import LoadedModel


class _ConstantLogits(torch.nn.Module):
    def __init__(self, vocab_size: int, token_id: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.token_id = token_id

    def forward(self, batch: StepBatch, kv: PagedKV) -> torch.Tensor:
        logits = torch.zeros(batch.logits_indices.numel(), self.vocab_size)  # the sampling rows
        logits[:, self.token_id] = 1.0
        return logits


def stub_model(loaded: LoadedModel, text: str = " ok") -> LoadedModel:
    """`loaded` with a transformer that emits the first token of `text`, forever (until max_tokens)."""
    token_id = loaded.tokenizer.encode(text, add_special_tokens=False).ids[0]
    return dataclasses.replace(loaded, model=_ConstantLogits(loaded.config.vocab_size, token_id))
