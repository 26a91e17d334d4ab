"""Mixtral: Llama attention (a sliding window where config.json sets one), a sparse MLP of
num_local_experts experts (w1 = gate, w3 = up, w2 = down), top-k weights always renormalised.

llama.cpp writes Mixtral as a `llama` GGUF with `expert_count` set, q/k rows permuted and experts stacked.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from worker.model.config import ModelConfig
from worker.model.decoder import Block, DecoderModel
from worker.model.families.base import Family, attention, lm_head, norm
from worker.model.families.llama import every_layer
from worker.model.families.qwen3 import MoeOptions, sparse_moe
from worker.model.gguf_metadata import GGUFTensors, Metadata
from worker.model.weight_builder import WeightBuilder


class Mixtral(Family):
    name, key = "Mixtral", "mixtral"
    hf_model_types = ("mixtral",)
    gguf_architectures = ("llama",)
    gguf_permuted_qk = True
    gguf_layer_names = {
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
        "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
        "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
    }

    def matches_gguf(self, meta: Metadata) -> bool:
        return meta.arch == "llama" and bool(meta.arch_get("expert_count"))

    def config_from_hf(self, raw: dict[str, Any]) -> ModelConfig:
        fields = self.hf_fields(raw)
        fields["layer_windows"] = every_layer(int(raw.get("sliding_window") or 0), fields["num_layers"])
        options = MoeOptions(
            num_experts=int(raw["num_local_experts"]),
            experts_per_token=int(raw["num_experts_per_tok"]),
            expert_intermediate_size=fields["intermediate_size"],
            normalize_top_k=True,
            sparse_layers=(True,) * fields["num_layers"],
        )
        return ModelConfig(**fields, options=options)

    def config_from_gguf(self, meta: Metadata, tensors: GGUFTensors) -> ModelConfig:
        fields = self.gguf_fields(meta, tensors)
        fields["layer_windows"] = every_layer(int(meta.arch_get("attention.sliding_window") or 0), fields["num_layers"])
        config = ModelConfig(**fields)
        options = MoeOptions(
            num_experts=meta.arch_int("expert_count"),
            experts_per_token=meta.arch_int("expert_used_count"),
            expert_intermediate_size=config.intermediate_size,
            normalize_top_k=True,
            sparse_layers=(True,) * config.num_layers,
        )
        return replace(config, options=options)

    def layer(self, config: ModelConfig, weights: WeightBuilder, index: int) -> Block:
        prefix = f"model.layers.{index}."
        moe = prefix + "block_sparse_moe."
        experts = [
            (f"{moe}experts.{e}.w1", f"{moe}experts.{e}.w3", f"{moe}experts.{e}.w2")
            for e in range(config.options.num_experts)
        ]
        return Block(
            norm(weights, prefix + "input_layernorm.weight", config),
            attention(weights, config, prefix + "self_attn."),
            norm(weights, prefix + "post_attention_layernorm.weight", config),
            sparse_moe(weights, config, moe + "gate.weight", experts),
        )

    def build(self, config: ModelConfig, weights: WeightBuilder) -> torch.nn.Module:
        layers = [self.layer(config, weights, i) for i in weights.layer_range(config)]
        embed = weights.embedding("model.embed_tokens.weight")
        return DecoderModel(
            config, embed, layers, norm(weights, "model.norm.weight", config), lm_head(weights, config, embed)
        )
