"""The contract between the engine and the model: one step's tokens and where their K/V live.

The engine (scheduler + kv_cache) builds a StepBatch every step; the model's forward reads
it together with the paged KV pool and returns logits for the sequences that sample.
Prefill chunks and decodes of many sequences travel in the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedKV:
    """The KV pool: one K and one V tensor of shape [layers, pages, page_size, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]


@dataclass
class StepBatch:
    """All new tokens of one step, sequence after sequence.

    T = total new tokens, S = sequences in the step.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token within its sequence
    slots: torch.Tensor  # [T] int64, page * page_size + offset where each token's K/V is written
    query_lens: list[int]  # [S] new tokens per sequence this step (1 for a decode)
    context_lens: list[int]  # [S] tokens in the cache for each sequence after this step
    page_tables: torch.Tensor  # [S, max_pages] int64 page ids per sequence, padded with 0
    logits_indices: torch.Tensor  # [R] index into T of the last new token of each sequence that samples
    # Whether decodes sharing leading pages may attend to them once (cascade attention): the CPU's
    # `aten` flash op only, so the step backend that builds the batch says (worker/runtime/).
    cascade: bool = True
    # [S] whether each sequence's sampled row is its prompt's last token (the answer's first token comes
    # from it, which the CPU's int8 activations never compute: worker/native/decoder_step.cpp); a long
    # prompt's earlier chunks sample nothing. None (a batch built by hand): every sampled row is taken for one.
    prompt_ends: list[bool] | None = None

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)
