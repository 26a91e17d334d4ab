"""Qwen3 (per-head RMSNorm on q and k before the rotary) and Qwen3-MoE (the same attention, sparse MLPs).

Qwen3-MoE: a layer is sparse unless listed in mlp_only_layers or skipped by decoder_sparse_step;
its router picks num_experts_per_tok of num_experts experts (weights renormalised when
norm_topk_prob). llama.cpp stores each layer's experts stacked (blk.N.ffn_{gate,up,down}_exps);
the GGUF loader splits them back into the HF per-expert tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from worker.model.config import ModelConfig, hf_layer_windows
from worker.model.decoder import Block, DecoderModel
from worker.model.families.base import Family, attention, gated_mlp, lm_head, norm
from worker.model.gguf_metadata import GGUFTensors, Metadata
from worker.model.moe import SparseMoE
from worker.model.quant_linear import DenseLinear
from worker.model.weight_builder import WeightBuilder


@dataclass(frozen=True)
class MoeOptions:
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    normalize_top_k: bool
    sparse_layers: tuple[bool, ...]


def router(weights: WeightBuilder, name: str) -> DenseLinear:
    """Routers stay dense in every weight mode: a quantized router can pick different experts."""
    return DenseLinear(weights.tensor(name), None)


def sparse_moe(
    weights: WeightBuilder, config: ModelConfig, gate: str, expert_modules: list[tuple[str, str, str]]
) -> SparseMoE:
    """expert_modules: (gate, up, down) module names of each expert, in expert order."""
    options: MoeOptions = config.options
    experts = [gated_mlp(weights, [g, u], d, options.expert_intermediate_size) for g, u, d in expert_modules]
    return SparseMoE(router(weights, gate), experts, options.experts_per_token, options.normalize_top_k)


class Qwen3(Family):
    name, key = "Qwen3", "qwen3"
    hf_model_types = ("qwen3",)
    gguf_architectures = ("qwen3",)

    def config_from_hf(self, raw: dict[str, Any]) -> ModelConfig:
        fields = self.hf_fields(raw)
        if raw.get("use_sliding_window") and raw.get("sliding_window"):
            layers = fields["num_layers"]
            start = int(raw.get("max_window_layers", layers))
            default = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
            fields["layer_windows"] = hf_layer_windows(raw, layers, default)
        return ModelConfig(**fields)

    def config_from_gguf(self, meta: Metadata, tensors: GGUFTensors) -> ModelConfig:
        return ModelConfig(**self.gguf_fields(meta, tensors))

    def mlp(self, config: ModelConfig, weights: WeightBuilder, index: int) -> torch.nn.Module:
        mlp = f"model.layers.{index}.mlp."
        return gated_mlp(weights, [mlp + "gate_proj", mlp + "up_proj"], mlp + "down_proj", config.intermediate_size)

    def layer(self, config: ModelConfig, weights: WeightBuilder, index: int) -> Block:
        prefix = f"model.layers.{index}."
        attn = prefix + "self_attn."
        q_norm, k_norm = norm(weights, attn + "q_norm.weight", config), norm(weights, attn + "k_norm.weight", config)
        return Block(
            norm(weights, prefix + "input_layernorm.weight", config),
            attention(weights, config, attn, q_norm=q_norm, k_norm=k_norm),
            norm(weights, prefix + "post_attention_layernorm.weight", config),
            self.mlp(config, weights, index),
        )

    def build(self, config: ModelConfig, weights: WeightBuilder) -> torch.nn.Module:
        layers = [self.layer(config, weights, i) for i in weights.layer_range(config)]
        embed = weights.embedding("model.embed_tokens.weight")
        return DecoderModel(
            config, embed, layers, norm(weights, "model.norm.weight", config), lm_head(weights, config, embed)
        )


class Qwen3Moe(Qwen3):
    name, key = "Qwen3-MoE", "qwen3_moe"
    hf_model_types = ("qwen3_moe",)
    gguf_architectures = ("qwen3moe",)
    gguf_layer_names = {
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
        "ffn_up_exps": "mlp.experts.{e}.up_proj",
        "ffn_down_exps": "mlp.experts.{e}.down_proj",
    }

    def config_from_hf(self, raw: dict[str, Any]) -> ModelConfig:
        config = super().config_from_hf(raw)
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step") or 1)
        dense = set(raw.get("mlp_only_layers") or ())
        sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(config.num_layers))
        options = MoeOptions(
            num_experts=experts,
            experts_per_token=int(raw["num_experts_per_tok"]),
            expert_intermediate_size=int(raw["moe_intermediate_size"]),
            normalize_top_k=bool(raw.get("norm_topk_prob", False)),
            sparse_layers=sparse,
        )
        return replace(config, options=options)

    def config_from_gguf(self, meta: Metadata, tensors: GGUFTensors) -> ModelConfig:
        config = super().config_from_gguf(meta, tensors)
        options = MoeOptions(
            num_experts=meta.arch_int("expert_count"),
            experts_per_token=meta.arch_int("expert_used_count"),
            expert_intermediate_size=meta.arch_int("expert_feed_forward_length"),
            normalize_top_k=bool(meta.arch_get("expert_weights_norm", True)),  # llama.cpp always renormalises Qwen3-MoE
            sparse_layers=(True,) * config.num_layers,
        )
        return replace(config, options=options)

    def mlp(self, config: ModelConfig, weights: WeightBuilder, index: int) -> torch.nn.Module:
        if not config.options.sparse_layers[index]:
            return super().mlp(config, weights, index)
        mlp = f"model.layers.{index}.mlp."
        experts = [
            (f"{mlp}experts.{e}.gate_proj", f"{mlp}experts.{e}.up_proj", f"{mlp}experts.{e}.down_proj")
            for e in range(config.options.num_experts)
        ]
        return sparse_moe(weights, config, mlp + "gate.weight", experts)
