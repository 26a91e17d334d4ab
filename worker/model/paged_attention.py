"""Attention over the paged KV pool for a mixed step of prefill chunks and decodes.

The gather indices and masks depend only on the batch, so `plan_attention` builds them once per
forward and every layer reuses them. Decodes share one padded gather and one attention call;
prefill chunks run per sequence (their query counts differ too much to pad).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.batch import StepBatch


@dataclass
class PrefillPlan:
    start: int  # first token of the chunk in the step
    end: int
    key_slots: torch.Tensor  # [context] slots of all the sequence's keys
    mask: torch.Tensor | None  # [q, context] bool, None when q == context (plain causal)


@dataclass
class DecodePlan:
    token_index: torch.Tensor | None  # [D] tokens in the step; None when every token decodes
    key_slots: torch.Tensor  # [D, max_context] slots, padded with slot 0
    mask: torch.Tensor  # [D, 1, 1, max_context] bool, True = attend


@dataclass
class AttentionPlan:
    decode: DecodePlan | None
    prefills: list[PrefillPlan]


def _key_slots(page_table: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Slots of key positions 0..length-1 for page tables [..., max_pages] -> [..., length]."""
    positions = torch.arange(length, device=page_table.device)
    pages = page_table[..., positions // page_size]
    return pages * page_size + positions % page_size


def _plan_decode(batch: StepBatch, decode_seqs: list[int], starts: list[int], page_size: int, device: torch.device) -> DecodePlan:
    seq_index = torch.tensor(decode_seqs, device=device)
    contexts = torch.tensor([batch.context_lens[s] for s in decode_seqs], device=device)
    longest = int(max(batch.context_lens[s] for s in decode_seqs))
    key_slots = _key_slots(batch.page_tables.to(device)[seq_index], longest, page_size)
    mask = torch.arange(longest, device=device)[None, :] < contexts[:, None]
    every_token = len(decode_seqs) == len(batch.query_lens)
    token_index = None if every_token else torch.tensor([starts[s] for s in decode_seqs], device=device)
    return DecodePlan(token_index=token_index, key_slots=key_slots, mask=mask[:, None, None, :])


def _plan_prefill(batch: StepBatch, seq: int, start: int, page_size: int, device: torch.device) -> PrefillPlan:
    query_len, context = batch.query_lens[seq], batch.context_lens[seq]
    key_slots = _key_slots(batch.page_tables[seq].to(device), context, page_size)
    mask = None
    if query_len != context:
        query_pos = torch.arange(context - query_len, context, device=device)
        mask = torch.arange(context, device=device)[None, :] <= query_pos[:, None]
    return PrefillPlan(start=start, end=start + query_len, key_slots=key_slots, mask=mask)


def plan_attention(batch: StepBatch, page_size: int, device: torch.device) -> AttentionPlan:
    starts = [0]
    for query_len in batch.query_lens:
        starts.append(starts[-1] + query_len)
    decode_seqs = [s for s, q in enumerate(batch.query_lens) if q == 1]
    decode = _plan_decode(batch, decode_seqs, starts, page_size, device) if decode_seqs else None
    prefills = [
        _plan_prefill(batch, s, starts[s], page_size, device) for s, q in enumerate(batch.query_lens) if q > 1
    ]
    return AttentionPlan(decode=decode, prefills=prefills)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    plan: AttentionPlan,
) -> torch.Tensor:
    """Write k/v [T, kv_heads, D] into one layer's pool at `slots`, attend q [T, heads, D]; returns [T, heads, D]."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache = k_pool.view(-1, kv_heads, head_dim)
    v_cache = v_pool.view(-1, kv_heads, head_dim)
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
    if plan.decode is not None and plan.decode.token_index is None:
        return _attend_decodes(q, k_cache, v_cache, plan.decode)
    out = torch.empty_like(q)
    if plan.decode is not None:
        out[plan.decode.token_index] = _attend_decodes(q[plan.decode.token_index], k_cache, v_cache, plan.decode)
    for prefill in plan.prefills:
        out[prefill.start : prefill.end] = _attend_prefill(q[prefill.start : prefill.end], k_cache, v_cache, prefill)
    return out


def _attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
    keys = k_cache[plan.key_slots].to(q.dtype).transpose(1, 2)  # [D, kv_heads, L, head_dim]
    values = v_cache[plan.key_slots].to(q.dtype).transpose(1, 2)
    decodes, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    # Each KV head's query heads as its rows of queries (head h reads KV head h // group): the same
    # attention as enable_gqa, but CPU SDPA is ~3x faster in bfloat16 with several queries than with one.
    queries = q.view(decodes, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.mask)
    return out.view(decodes, heads, head_dim)


def _attend_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
    keys = k_cache[plan.key_slots].to(q.dtype).transpose(0, 1)[None]  # [1, kv_heads, context, head_dim]
    values = v_cache[plan.key_slots].to(q.dtype).transpose(0, 1)[None]
    queries = q.transpose(0, 1)[None]  # [1, heads, q, head_dim]
    if plan.mask is None:
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.mask, enable_gqa=True)
    return out[0].transpose(0, 1)
