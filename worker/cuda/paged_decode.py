"""Decode attention that reads K/V pages where they lie: a Triton kernel on CUDA, a torch reference elsewhere.

The CPU path (worker/model/paged_attention.py) gathers every decode's keys into a padded tensor and
calls SDPA: right on a CPU, but on a GPU that copy costs as much as the attention itself and its
shape changes every step, so it cannot live in a CUDA graph. Here one program per (sequence, KV
head, split) walks the sequence's page table, loads each key and value once for all the query
heads that share it (GQA), and keeps an online softmax in float32. Nothing in the launch depends
on the step's lengths: the context lengths are read on the device, so one captured launch serves
any mix of lengths up to the page table's width.

Splits (flash-decoding): with few sequences, sequences x KV heads programs leave most of the GPU
idle, so each sequence's keys are cut into `num_splits` contiguous ranges computed in parallel and
merged by a second small kernel. A padding row has context length 0 and slot -1: it reads and
writes nothing and its output is zeros.

`PagedDecode` is the plan a decode-only step hands to paged_attention: it writes the step's K/V
into the pool (skipping slot -1) and attends, with the kernels of worker/cuda/triton_decode.py on
CUDA and the torch reference below elsewhere. `PagedDecodeBatch` is a StepBatch that carries one,
so `plan_attention` can return it instead of building gather indices (docs/gpu.md: the two lines).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from worker.batch import StepBatch
from worker.cuda.triton_decode import decode, store_kv

MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more to merge than it saves


@dataclass(frozen=True)
class PagedDecode:
    """Everything a decode-only step's attention reads besides q/k/v and the pool, as device tensors."""

    page_tables: torch.Tensor  # [S, W] page ids; columns past a sequence's last page are never read
    context_lens: torch.Tensor  # [S] tokens in the cache after this step; 0 marks a padding row
    page_size: int
    num_splits: int = 1
    window: int = 0  # each query sees its `window` most recent keys; 0 = all

    def for_window(self, window: int) -> PagedDecode:
        return self if window == self.window else replace(self, window=window)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """paged_attention's contract: write k/v [T, kv_heads, D] at `slots`, return q's attention [T, heads, D].

        softcap: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2).
        """
        if q.is_cuda:
            store_kv(k, v, k_pool, v_pool, slots)
            return decode(q, k_pool, v_pool, self.page_tables, self.context_lens, scale=scale,
                          window=self.window, num_splits=self.num_splits, softcap=softcap)  # fmt: skip
        store_kv_reference(k, v, k_pool, v_pool, slots)
        return decode_reference(q, k_pool, v_pool, self.page_tables, self.context_lens, scale=scale,
                                window=self.window, softcap=softcap)  # fmt: skip


@dataclass
class PagedDecodeBatch(StepBatch):
    """A decode-only StepBatch whose attention plan is already made (static buffers of a CUDA graph)."""

    decode: PagedDecode | None = None


def choose_splits(sequences: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough splits to give every multiprocessor about two programs, none shorter than MIN_SPLIT_TOKENS."""
    if device.type != "cuda":
        return 1
    programs_wanted = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    splits = 1
    while (
        splits < MAX_SPLITS
        and sequences * kv_heads * splits < programs_wanted
        and max_context >= 2 * splits * MIN_SPLIT_TOKENS
    ):
        splits *= 2
    return splits


# ------------------------------------------------------------------ torch reference (CPU, and the tests' truth)


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor
) -> None:
    kv_heads, head_dim = k.shape[1], k.shape[2]
    keep = slots >= 0
    k_pool.view(-1, kv_heads, head_dim).index_copy_(0, slots[keep], k[keep].to(k_pool.dtype))
    v_pool.view(-1, kv_heads, head_dim).index_copy_(0, slots[keep], v[keep].to(v_pool.dtype))


def decode_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """The same attention by gathering every key of the page table's width, in float32."""
    sequences, heads, head_dim = q.shape
    page_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    width = page_tables.shape[1] * page_size
    positions = torch.arange(width, device=q.device)
    slots = page_tables[:, positions // page_size].long() * page_size + positions % page_size  # [S, width]
    keys = k_pool.reshape(-1, kv_heads, head_dim)[slots].float().permute(0, 2, 1, 3)  # [S, kvh, width, D]
    values = v_pool.reshape(-1, kv_heads, head_dim)[slots].float().permute(0, 2, 1, 3)
    queries = q.float().view(sequences, kv_heads, heads // kv_heads, head_dim)
    contexts = context_lens.long()[:, None]
    visible = positions[None, :] < contexts
    if window:
        visible &= positions[None, :] >= contexts - window
    scores = queries @ keys.transpose(-1, -2) * (scale if scale is not None else head_dim**-0.5)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    weights = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)  # a row with no key (padding) attends to nothing
    return (weights @ values).view(sequences, heads, head_dim).to(q.dtype)
