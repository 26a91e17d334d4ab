"""Attention over the paged KV pool for a mixed step of prefill chunks and decodes.

The gather indices and masks depend only on the batch, so `plan_attention` builds them once per
forward and every layer reuses them. Decodes share one padded gather and one attention call;
prefill chunks run per sequence (their query counts differ too much to pad).

Keys are gathered by whole pages: one `index_select` of page ids copies contiguous blocks of
`page_size` tokens, where gathering token by token through an index tensor took 3x as long, and
SDPA reads the gathered keys through a strided view, never a transposed copy. A prefill chunk that
starts its sequence attends to its own new keys and gathers nothing.

Decodes that share leading pages (a system prompt in the prefix cache) attend to those pages once
for all of them: every decode's queries against the shared keys in one call, each decode's queries
against its own remaining keys in a second, and the two results merged by their log-sum-exps
(cascade attention, only where the batch allows it: `StepBatch.cascade`, which only the CPU step
backends set, since its op is the CPU's). With 16 decodes behind a 1,000-token shared prompt, that gathers and reads the
prompt's keys once per layer instead of 16 times.

A sliding window (Mistral, Gemma's local layers) is only a different plan: each query sees its
`window` most recent keys, so decodes gather just the pages holding those and prefills mask the
older ones. The KV pool is the same for every layer; a windowed layer simply never reads the old pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from worker.batch import StepBatch
from worker.cuda.paged_decode import PagedDecode, PagedDecodeBatch

MIN_SHARED_PAGES = (
    4  # below this many shared pages (64 tokens at 16 a page), one padded gather is cheaper than two calls
)


@dataclass
class PrefillPlan:
    start: int  # first token of the chunk in the step
    end: int
    pages: torch.Tensor | None  # [n] pages holding keys first_key..context-1; None: the chunk's own keys are all
    offset: int  # first_key's index in the gathered pages' tokens
    length: int  # keys attended: context - first_key
    mask: torch.Tensor | None  # [q, length] bool, None when q == length (plain causal)


@dataclass
class DecodePlan:
    token_index: torch.Tensor | None  # [D] tokens in the step; None when every token decodes
    pages: torch.Tensor  # [D, P] page ids of each decode's keys, padded with page 0
    mask: torch.Tensor  # [D, 1, 1, P * page_size] bool, True = attend
    shared_pages: int = 0  # leading columns of `pages` every decode shares, attended once (cascade)
    _additive: dict = field(default_factory=dict, repr=False)

    def additive_mask(self, dtype: torch.dtype, first_page: int, page_size: int) -> torch.Tensor:
        """The mask from key `first_page * page_size` on, as 0 / -inf in `dtype`: built once per step, not per layer."""
        key = (dtype, first_page)
        if key not in self._additive:
            visible = self.mask[..., first_page * page_size :]
            self._additive[key] = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
                ~visible, float("-inf")
            )
        return self._additive[key]


@dataclass
class AttentionPlan:
    decode: DecodePlan | None
    prefills: list[PrefillPlan]


def _plan_decode(
    batch: StepBatch, decode_seqs: list[int], starts: list[int], page_size: int, device: torch.device, window: int
) -> DecodePlan:
    """The pages holding each decode's visible keys (its last `window`, or all) and which of their tokens it sees."""
    seq_index = torch.tensor(decode_seqs, device=device)
    context_list = [batch.context_lens[s] for s in decode_seqs]
    contexts = torch.tensor(context_list, device=device)
    page_tables = batch.page_tables.to(device)[seq_index]
    if window:
        first_page = (contexts - window).clamp(min=0) // page_size
        count = int(((contexts - 1) // page_size - first_page).max()) + 1
        columns = (first_page[:, None] + torch.arange(count, device=device)[None, :]).clamp(
            max=page_tables.shape[1] - 1
        )
        pages = page_tables.gather(1, columns)
        positions = first_page[:, None] * page_size + torch.arange(count * page_size, device=device)[None, :]
        visible = (positions < contexts[:, None]) & (positions >= contexts[:, None] - window)
        shared = 0
    else:
        count = -(-max(context_list) // page_size)
        pages = page_tables[:, :count]
        visible = torch.arange(count * page_size, device=device)[None, :] < contexts[:, None]
        shared = _shared_pages(pages, min(context_list), page_size) if batch.cascade else 0
    every_token = len(decode_seqs) == len(batch.query_lens)
    token_index = None if every_token else torch.tensor([starts[s] for s in decode_seqs], device=device)
    return DecodePlan(token_index=token_index, pages=pages, mask=visible[:, None, None, :], shared_pages=shared)


def _shared_pages(pages: torch.Tensor, shortest_context: int, page_size: int) -> int:
    """Leading pages every row holds, each full and before every decode's newest key; 0 when too few to pay."""
    if pages.shape[0] < 2:
        return 0
    same = (pages == pages[:1]).all(dim=0).int().cumprod(dim=0)
    shared = min(int(same.sum()), (shortest_context - 1) // page_size)
    return shared if shared >= MIN_SHARED_PAGES else 0


def _plan_prefill(
    batch: StepBatch, seq: int, start: int, page_size: int, device: torch.device, window: int
) -> PrefillPlan:
    query_len, context = batch.query_lens[seq], batch.context_lens[seq]
    end = start + query_len
    if query_len == context and (not window or context <= window):
        return PrefillPlan(start=start, end=end, pages=None, offset=0, length=context, mask=None)
    first_key = max(0, context - query_len - window + 1) if window else 0  # older keys are outside every window
    pages = batch.page_tables[seq, first_key // page_size : (context - 1) // page_size + 1].to(device)
    key_pos = torch.arange(first_key, context, device=device)[None, :]
    query_pos = torch.arange(context - query_len, context, device=device)[:, None]
    mask = key_pos <= query_pos
    if window:
        mask &= key_pos > query_pos - window
    return PrefillPlan(
        start=start, end=end, pages=pages, offset=first_key % page_size, length=context - first_key, mask=mask
    )


def plan_attention(batch: StepBatch, page_size: int, device: torch.device, window: int = 0) -> AttentionPlan:
    """window: each query sees its `window` most recent keys (itself included); 0 = the whole context."""
    if isinstance(batch, PagedDecodeBatch):  # a CUDA decode step: the paged kernel plans it (worker/cuda/)
        return batch.decode.for_window(window)
    starts = [0]
    for query_len in batch.query_lens:
        starts.append(starts[-1] + query_len)
    decode_seqs = [s for s, q in enumerate(batch.query_lens) if q == 1]
    decode = _plan_decode(batch, decode_seqs, starts, page_size, device, window) if decode_seqs else None
    prefills = [
        _plan_prefill(batch, s, starts[s], page_size, device, window) for s, q in enumerate(batch.query_lens) if q > 1
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
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write k/v [T, kv_heads, D] into one layer's pool at `slots`, attend q [T, heads, D]; returns [T, heads, D].

    k_pool/v_pool: the layer's [pages, page_size, kv_heads, D]. scale: the factor on q·k (None: 1/sqrt(head_dim)).
    softcap: scores become cap * tanh(score / cap) before the softmax (Gemma 2); SDPA cannot, so such a layer
    attends with an explicit matmul-softmax.
    """
    if isinstance(plan, PagedDecode):
        return plan.attend(q, k, v, k_pool, v_pool, slots, scale, softcap=softcap)
    if softcap is not None:
        return _softcapped_paged_attention(q, k, v, k_pool, v_pool, slots, plan, scale=scale, softcap=softcap)
    write_kv(k, v, k_pool, v_pool, slots)
    if plan.decode is not None and plan.decode.token_index is None:
        return _attend_decodes(q, k_pool, v_pool, plan.decode, scale)
    out = torch.empty_like(q)
    if plan.decode is not None:
        out[plan.decode.token_index] = _attend_decodes(q[plan.decode.token_index], k_pool, v_pool, plan.decode, scale)
    for prefill in plan.prefills:
        chunk = slice(prefill.start, prefill.end)
        keys, values = prefill_keys_values(k[chunk], v[chunk], k_pool, v_pool, prefill, q.dtype)
        out[chunk] = _attend_prefill(q[chunk], keys, values, prefill.mask, scale)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> None:
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_pool.view(-1, kv_heads, head_dim).index_copy_(0, slots, k.to(k_pool.dtype))
    v_pool.view(-1, kv_heads, head_dim).index_copy_(0, slots, v.to(v_pool.dtype))


def gather_pages(pool: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pool [pages, page_size, kv_heads, D], pages [..., n] -> [..., n * page_size, kv_heads, D] (a copy)."""
    gathered = pool.index_select(0, pages.reshape(-1)).to(dtype)
    return gathered.view(*pages.shape[:-1], pages.shape[-1] * pool.shape[1], *pool.shape[2:])


def decode_keys_values(
    k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the pages [D, P] as [D, kv_heads, P * page_size, head_dim] (strided views of one copy)."""
    return gather_pages(k_pool, pages, dtype).transpose(1, 2), gather_pages(v_pool, pages, dtype).transpose(1, 2)


def prefill_keys_values(
    k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: PrefillPlan, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's visible keys and values as [1, kv_heads, length, head_dim]; k/v are the chunk's own new ones."""
    if plan.pages is None:  # as read back from the pool: rounded to its dtype
        return k.to(k_pool.dtype).to(dtype).transpose(0, 1)[None], v.to(v_pool.dtype).to(dtype).transpose(0, 1)[None]
    window = slice(plan.offset, plan.offset + plan.length)
    keys = gather_pages(k_pool, plan.pages, dtype)[window]
    values = gather_pages(v_pool, plan.pages, dtype)[window]
    return keys.transpose(0, 1)[None], values.transpose(0, 1)[None]


def _attend_decodes(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: DecodePlan, scale: float | None = None
) -> torch.Tensor:
    decodes, heads, head_dim = q.shape
    kv_heads = k_pool.shape[2]
    page_size = k_pool.shape[1]
    # Each KV head's query heads as its rows of queries (head h reads KV head h // group): the same
    # attention as enable_gqa, but CPU SDPA is ~3x faster in bfloat16 with several queries than with one.
    queries = q.view(decodes, kv_heads, heads // kv_heads, head_dim)
    if plan.shared_pages:
        return _attend_cascade(queries, k_pool, v_pool, plan, scale).reshape(decodes, heads, head_dim)
    keys, values = decode_keys_values(k_pool, v_pool, plan.pages, q.dtype)
    mask = plan.additive_mask(q.dtype, 0, page_size)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return out.view(decodes, heads, head_dim)


def _attend_cascade(
    queries: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: DecodePlan, scale: float | None
) -> torch.Tensor:
    """queries [D, kv_heads, group, hd]: the shared pages once for every decode, then each decode's own, merged."""
    decodes, kv_heads, group, head_dim = queries.shape
    shared = plan.shared_pages
    keys, values = decode_keys_values(k_pool, v_pool, plan.pages[:1, :shared], queries.dtype)  # [1, kvh, Ls, hd]
    every_query = queries.transpose(0, 1).reshape(1, kv_heads, decodes * group, head_dim)
    shared_out, shared_lse = _flash(every_query, keys, values, None, scale)
    shared_out = shared_out.view(kv_heads, decodes, group, head_dim).transpose(0, 1)
    shared_lse = shared_lse.view(kv_heads, decodes, group).transpose(0, 1)
    keys, values = decode_keys_values(k_pool, v_pool, plan.pages[:, shared:], queries.dtype)
    own_out, own_lse = _flash(queries, keys, values, plan.additive_mask(queries.dtype, shared, k_pool.shape[1]), scale)
    return merge_attention(shared_out, shared_lse, own_out, own_lse)


def _flash(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention with its log-sum-exp [B, H, q] (float32); the public SDPA does not return it."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries, keys, values, attn_mask=mask, scale=scale
    )


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets from each one's output and log-sum-exp (in float32)."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a, weight_b = (lse_a - lse).exp()[..., None], (lse_b - lse).exp()[..., None]
    return (out_a.float() * weight_a + out_b.float() * weight_b).to(out_a.dtype)


def _attend_prefill(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """queries [q, heads, hd] against keys/values [1, kv_heads, length, hd]."""
    queries = queries.transpose(0, 1)[None]  # [1, heads, q, head_dim]
    if mask is None:
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True, scale=scale)
    return out[0].transpose(0, 1)


def _softcapped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, values)


def _softcapped_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    plan: AttentionPlan,
    *,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """paged_attention with the scores soft-capped before the softmax (same plans, same pool; no cascade)."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    write_kv(k, v, k_pool, v_pool, slots)
    out = torch.empty_like(q)
    if plan.decode is not None:
        index = plan.decode.token_index
        queries = q if index is None else q[index]
        keys, values = decode_keys_values(k_pool, v_pool, plan.decode.pages, q.dtype)  # [D, kv_heads, L, head_dim]
        grouped = queries.reshape(-1, kv_heads, group, head_dim)
        attended = _softcapped_attention(grouped, keys, values, plan.decode.mask, scale, softcap).reshape(
            -1, heads, head_dim
        )
        if index is None:
            out[:] = attended
        else:
            out[index] = attended
    for prefill in plan.prefills:
        chunk = slice(prefill.start, prefill.end)
        queries = q[chunk]
        keys, values = prefill_keys_values(
            k[chunk], v[chunk], k_pool, v_pool, prefill, q.dtype
        )  # [1, kv_heads, length, hd]
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [kv_heads, 1, length, head_dim]
        count, context = queries.shape[0], prefill.length
        mask = prefill.mask
        if mask is None:
            mask = torch.ones(count, context, dtype=torch.bool, device=q.device).tril(context - count)
        grouped = queries.reshape(count, kv_heads, group, head_dim).permute(
            1, 2, 0, 3
        )  # [kv_heads, group, count, head_dim]
        attended = _softcapped_attention(grouped, keys, values, mask, scale, softcap)
        out[chunk] = attended.permute(2, 0, 1, 3).reshape(count, heads, head_dim)
    return out
