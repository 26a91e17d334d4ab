"""A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) whose forward reads and writes the paged KV pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.batch import PagedKV, StepBatch
from worker.model.config import ModelConfig
from worker.model.embedding import TokenEmbedding
from worker.model.norm import RMSNorm
from worker.model.paged_attention import AttentionPlan, paged_attention, plan_attention
from worker.model.rope import Rotary, apply_rotary


class DecoderLayer(torch.nn.Module):
    """qkv and gate/up are fused into one linear each: fewer kernel calls per decode step."""

    def __init__(
        self,
        config: ModelConfig,
        input_norm: RMSNorm,
        qkv: torch.nn.Module,
        o_proj: torch.nn.Module,
        post_attention_norm: RMSNorm,
        gate_up: torch.nn.Module,
        down: torch.nn.Module,
    ) -> None:
        super().__init__()
        self.input_norm, self.qkv, self.o_proj = input_norm, qkv, o_proj
        self.post_attention_norm, self.gate_up, self.down = post_attention_norm, gate_up, down
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.intermediate_size = config.intermediate_size

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
        tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qk, v = self.qkv(self.input_norm(hidden)).split((q_size + kv_size, kv_size), dim=-1)
        qk = apply_rotary(
            qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin
        )  # one pass for q and k
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        attention = paged_attention(q, k, v, k_pool, v_pool, slots, plan)
        hidden = hidden + self.o_proj(attention.reshape(tokens, q_size))
        gate, up = self.gate_up(self.post_attention_norm(hidden)).split(self.intermediate_size, dim=-1)
        return hidden + self.down(F.silu(gate) * up)


class LlamaModel(torch.nn.Module):
    """model(batch, kv) -> float32 logits [S, vocab], one row per entry of batch.logits_indices."""

    def __init__(
        self,
        config: ModelConfig,
        embed_tokens: TokenEmbedding,
        layers: list[DecoderLayer],
        norm: RMSNorm,
        lm_head: torch.nn.Module,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.layers = torch.nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = Rotary(config)

    @torch.no_grad()
    def forward(self, batch: StepBatch, kv: PagedKV) -> torch.Tensor:
        device = self.embed_tokens.weight.device
        plan = plan_attention(batch, kv.page_size, device)
        slots = batch.slots.to(device)
        hidden = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions.to(device), hidden.dtype)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, kv.k[index], kv.v[index], slots, plan)
        last = self.norm(hidden[batch.logits_indices.to(device)])
        return self.lm_head(last).float()
