"""The decoder the families beyond plain Llama are assembled from.

A family's builder picks the pieces: which norms sit around attention and the MLP, whether q and k
are normalised per head, the attention scale and function, a dense or mixture-of-experts MLP,
which rotary and sliding window each layer uses. `DecoderModel` computes the per-step parts once
(one attention plan per distinct window, one cos/sin per rotary) and hands each layer its own.

Llama itself keeps its fused `worker.model.llama` path (no optional pieces on its hot loop); every
layer here has the same call signature as its DecoderLayer, so both kinds of layer fit this shell.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker.batch import PagedKV, StepBatch
from worker.model.config import ModelConfig
from worker.model.embedding import TokenEmbedding
from worker.model.norm import RMSNorm
from worker.model.paged_attention import AttentionPlan, paged_attention, plan_attention
from worker.model.rope import Rotary, apply_partial_rotary, apply_rotary

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

Attend = Callable[..., torch.Tensor]  # (q, k, v, k_pool, v_pool, slots, plan) -> [T, heads, head_dim]


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported MLP activation {name!r} (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class Attention(torch.nn.Module):
    """Fused q/k/v projection, optional per-head q/k RMSNorm, rotary, paged attention, output projection."""

    def __init__(
        self,
        config: ModelConfig,
        qkv: torch.nn.Module,
        o_proj: torch.nn.Module,
        *,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        attend: Attend = paged_attention,
    ) -> None:
        super().__init__()
        self.qkv, self.o_proj, self.q_norm, self.k_norm, self.attend = qkv, o_proj, q_norm, k_norm, attend
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.rotate = apply_rotary if config.rotary_dim == config.head_dim else apply_partial_rotary

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((q_size, kv_size, kv_size), dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        out = self.attend(q, k, v, k_pool, v_pool, slots, plan)
        return self.o_proj(out.reshape(tokens, q_size))


class GatedMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one linear."""

    def __init__(
        self, gate_up: torch.nn.Module, down: torch.nn.Module, intermediate_size: int, act: str = "silu"
    ) -> None:
        super().__init__()
        self.gate_up, self.down, self.intermediate_size = gate_up, down, intermediate_size
        self.activation, self.act = act, activation(act)  # the name: what the native step reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)
        return self.down(self.act(gate) * up)


class Block(torch.nn.Module):
    """A pre-norm residual layer; Gemma adds norms on the outputs too (post_attention_norm, post_mlp_norm)."""

    def __init__(
        self,
        input_norm: torch.nn.Module,
        attention: Attention,
        mlp_norm: torch.nn.Module,
        mlp: torch.nn.Module,
        post_attention_norm: torch.nn.Module | None = None,
        post_mlp_norm: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.input_norm, self.attention, self.mlp_norm, self.mlp = input_norm, attention, mlp_norm, mlp
        self.post_attention_norm, self.post_mlp_norm = post_attention_norm, post_mlp_norm

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        out = self.attention(self.input_norm(hidden), cos, sin, k_pool, v_pool, slots, plan)
        if self.post_attention_norm is not None:
            out = self.post_attention_norm(out)
        hidden = hidden + out
        out = self.mlp(self.mlp_norm(hidden))
        if self.post_mlp_norm is not None:
            out = self.post_mlp_norm(out)
        return hidden + out


class DecoderModel(torch.nn.Module):
    """model(batch, kv) -> float32 logits [S, vocab], like LlamaModel, with per-layer windows and rotaries.

    layer_rotary[i] indexes `rotaries` (Gemma 3: local and global bases); the window of layer i is
    config.window(i). embed_scale multiplies the embeddings (Gemma: sqrt(hidden), rounded to the
    compute dtype as HF does); final_softcap bounds the logits to (-cap, cap) with tanh (Gemma 2).
    """

    def __init__(
        self,
        config: ModelConfig,
        embed_tokens: TokenEmbedding,
        layers: list[torch.nn.Module],
        norm: torch.nn.Module,
        lm_head: torch.nn.Module,
        *,
        rotaries: list[Rotary] | None = None,
        layer_rotary: list[int] | None = None,
        embed_scale: float | None = None,
        final_softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.layers = torch.nn.ModuleList(layers)
        self.norm, self.lm_head = norm, lm_head
        self.rotaries = torch.nn.ModuleList(rotaries or [Rotary(config)])
        self.layer_rotary = layer_rotary or [0] * len(layers)
        self.layer_windows = [config.window(i) for i in range(len(layers))]
        self.embed_scale, self.final_softcap = embed_scale, final_softcap

    @torch.no_grad()
    def forward(self, batch: StepBatch, kv: PagedKV) -> torch.Tensor:
        device = self.embed_tokens.weight.device
        plans = {window: plan_attention(batch, kv.page_size, device, window) for window in set(self.layer_windows)}
        slots = batch.slots.to(device)
        hidden = self.embed_tokens(batch.input_ids)
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        positions = batch.positions.to(device)
        cos_sin = [rotary.cos_sin(positions, hidden.dtype) for rotary in self.rotaries]
        for index, layer in enumerate(self.layers):
            cos, sin = cos_sin[self.layer_rotary[index]]
            plan = plans[self.layer_windows[index]]
            hidden = layer(hidden, cos, sin, kv.k[index], kv.v[index], slots, plan)
        last = self.norm(hidden[batch.logits_indices.to(device)])
        logits = self.lm_head(last).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
