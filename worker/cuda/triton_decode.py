"""The Triton kernels of the paged decode (worker/cuda/paged_decode.py says what they compute) and their launches.

Built on first use, not at import: Triton's CPU interpreter must be switched on (TRITON_INTERPRET=1)
before triton is first imported, and a CPU worker never needs triton at all. CUDA tensors run the
compiled kernels; CPU tensors run them in the interpreter (tests/worker/cuda/test_paged_decode_interpret.py).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from dataclasses import dataclass

import torch

tl = None  # triton.language, set by `_kernels`: the kernels' source names it, Triton resolves it here

NO_WINDOW = 1 << 30  # "attend to everything": first key = max(context - NO_WINDOW, 0) = 0
REGISTER_ELEMENTS = 8192  # group x keys x head_dim float32 values one program keeps per block


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _decode_kernel(
    Q, K, V, PageTables, ContextLens, Out, PartAcc, PartMax, PartSum,
    qk_scale, window,
    q_stride_s, q_stride_h,
    k_stride_page, k_stride_tok, k_stride_h,
    v_stride_page, v_stride_tok, v_stride_h,
    pt_stride_s,
    o_stride_s, o_stride_h,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One (sequence, KV head, split): the GROUP query heads of that KV head over one range of keys.

    Scores are in log2 units (exp2 is the GPU's native exponential): qk_scale includes log2(e),
    except with a soft cap, which applies to the natural scores and converts after.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(ContextLens + seq).to(tl.int32)
    first = tl.maximum(context - window, 0)
    per_split = tl.cdiv(tl.cdiv(context - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, context)

    groups = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + groups
    dims = tl.arange(0, BLOCK_D)
    q_mask = (groups < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(Q + seq * q_stride_s + heads[:, None] * q_stride_h + dims[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32) * qk_scale

    best = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for block in range(start, end, BLOCK_N):
        pos = block + tl.arange(0, BLOCK_N)
        valid = pos < end
        page = tl.load(PageTables + seq * pt_stride_s + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        offset = (pos % PAGE_SIZE).to(tl.int64)
        kv_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
        k_rows = page * k_stride_page + offset * k_stride_tok + kv_head * k_stride_h
        k = tl.load(K + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, BLOCK_N]
        if SOFTCAP > 0:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1): saturates, never overflows
            scores = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * scores / SOFTCAP) + 1.0)) * 1.4426950408889634
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        rescale = tl.exp2(best - new_best)
        p = tl.exp2(scores - new_best[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        v_rows = page * v_stride_page + offset * v_stride_tok + kv_head * v_stride_h
        v = tl.load(V + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        best = new_best

    out = acc / tl.maximum(total, 1e-30)[:, None]  # no key (padding row, empty split): acc is 0, so is out
    if NUM_SPLITS == 1:
        o_ptrs = Out + seq * o_stride_s + heads[:, None] * o_stride_h + dims[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_mask)
    else:
        num_heads = tl.num_programs(1) * GROUP
        part = (seq * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G] rows of PartAcc
        tl.store(PartAcc + part[:, None] * HEAD_DIM + dims[None, :], out, mask=q_mask)
        tl.store(PartMax + part, best, mask=groups < GROUP)
        tl.store(PartSum + part, total, mask=groups < GROUP)


def _merge_kernel(
    PartAcc, PartMax, PartSum, Out, o_stride_s, o_stride_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """One (sequence, head): the splits' partial softmaxes weighted by their share of the total."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    best = tl.load(PartMax + row * NUM_SPLITS + splits)
    total = tl.load(PartSum + row * NUM_SPLITS + splits)
    overall = tl.max(best, axis=0)
    overall = tl.where(overall == float("-inf"), 0.0, overall)  # every split empty (a padding row)
    weight = tl.where(total > 0, total * tl.exp2(best - overall), 0.0)  # an empty split weighs nothing
    mask = (dims < HEAD_DIM)[None, :]
    parts = tl.load(PartAcc + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.maximum(tl.sum(weight, axis=0), 1e-30)
    tl.store(Out + seq * o_stride_s + head * o_stride_h + dims, out.to(Out.dtype.element_ty), mask=dims < HEAD_DIM)


def _store_kernel(
    K, V, KPool, VPool, Slots,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h, pool_stride_slot, pool_stride_h,
    KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One token: its K and V for every KV head into the pool at its slot; slot -1 (padding) writes nothing."""
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    slot = tl.load(Slots + token + heads * 0).to(tl.int64)  # the token's slot, once per head row
    mask = ((heads < KV_HEADS) & (slot >= 0))[:, None] & (dims < HEAD_DIM)[None, :]
    target = (tl.maximum(slot, 0) * pool_stride_slot + heads * pool_stride_h)[:, None] + dims[None, :]
    # through float32: the interpreter (numpy) has no bfloat16 arithmetic, and the cast is exact
    k = tl.load(K + token * k_stride_t + heads[:, None] * k_stride_h + dims[None, :], mask=mask, other=0.0)
    tl.store(KPool + target, k.to(tl.float32).to(KPool.dtype.element_ty), mask=mask)
    v = tl.load(V + token * v_stride_t + heads[:, None] * v_stride_h + dims[None, :], mask=mask, other=0.0)
    tl.store(VPool + target, v.to(tl.float32).to(VPool.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class _Kernels:
    decode: object
    merge: object
    store: object


@functools.cache
def _kernels(interpret: bool) -> _Kernels:
    """The kernels, compiled for the GPU or wrapped for Triton's CPU interpreter (decided per call, not at import)."""
    global tl
    if not triton_available():
        raise RuntimeError("the CUDA decode path needs triton (pip install triton)")
    import triton
    import triton.language

    tl = triton.language
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        wrap = InterpretedFunction
    else:
        wrap = triton.jit
    return _Kernels(decode=wrap(_decode_kernel), merge=wrap(_merge_kernel), store=wrap(_store_kernel))


def _interpret(tensor: torch.Tensor) -> bool:
    return not tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


def _floor_pow2(n: int) -> int:
    return 1 << max(1, n).bit_length() - 1


def store_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """k/v [T, kv_heads, D] into one layer's pool [pages, page_size, kv_heads, D] at `slots` (-1: skip)."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous()
    pool_stride_slot, pool_stride_h = kv_heads * head_dim, head_dim
    _kernels(_interpret(k)).store[(tokens,)](
        k, v, k_pool, v_pool, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), pool_stride_slot, pool_stride_h,
        KV_HEADS=kv_heads, BLOCK_H=_pow2(kv_heads), HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim),
    )  # fmt: skip


def decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int = 0,
    num_splits: int = 1,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence, q [S, heads, D], over its pages; returns [S, heads, D].

    k_pool/v_pool: one layer's pool [pages, page_size, kv_heads, D]; page_tables [S, W] (int32 or
    int64); context_lens [S]. CUDA tensors run the compiled kernel; CPU tensors run it in Triton's
    interpreter (slow: for tests).
    """
    sequences, heads, head_dim = q.shape
    _pages, page_size, kv_heads, _ = k_pool.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} KV heads evenly")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, not {num_splits}")
    assert q.stride(2) == 1 and k_pool.stride(3) == 1 and v_pool.stride(3) == 1 and page_tables.stride(1) == 1
    out = torch.empty_like(q) if out is None else out
    if sequences == 0:
        return out
    group = heads // kv_heads
    block_g, block_d = _pow2(group), _pow2(head_dim)
    block_n = max(8, min(64, _floor_pow2(REGISTER_ELEMENTS // (block_g * block_d))))
    kernels = _kernels(_interpret(q))
    qk_scale = scale if scale is not None else head_dim**-0.5
    if not softcap:
        qk_scale *= math.log2(math.e)
    if num_splits > 1:
        part_acc = torch.empty((sequences, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((sequences, heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty((sequences, heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_max = part_sum = out  # never touched with one split
    kernels.decode[(sequences, kv_heads, num_splits)](
        q, k_pool, v_pool, page_tables, context_lens, out, part_acc, part_max, part_sum,
        qk_scale, window if window > 0 else NO_WINDOW,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        page_tables.stride(0),
        out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, SOFTCAP=float(softcap or 0.0),
    )  # fmt: skip
    if num_splits > 1:
        kernels.merge[(sequences, heads)](
            part_acc, part_max, part_sum, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        )  # fmt: skip
    return out
