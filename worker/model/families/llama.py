"""Llama (1-3.x, SmolLM) and the families that are Llama with one twist: Mistral (a sliding window),
Qwen2/2.5 (q/k/v biases; a sliding window on the upper layers when enabled), Phi-3 (q/k/v and
gate/up stored fused; long-rope; Phi-4-mini's partial rotary).

They run on Llama's fused DecoderLayer. Without a sliding window the model is LlamaModel itself,
the same path and speed as before; with one, the same layers sit in a DecoderModel that plans the
window. Only partial rotary needs the generic Block (DecoderLayer rotates whole heads).
"""

from __future__ import annotations

from typing import Any

import torch

from worker.model.config import ModelConfig, RopeScaling, hf_layer_windows
from worker.model.decoder import Block, DecoderModel
from worker.model.families.base import Family, attention, fused_linear, gated_mlp, lm_head, norm
from worker.model.gguf_metadata import GGUFTensors, Metadata
from worker.model.llama import DecoderLayer, LlamaModel
from worker.model.weight_builder import WeightBuilder


def llama_layer(
    config: ModelConfig, weights: WeightBuilder, index: int, qkv: list[str], gate_up: list[str]
) -> torch.nn.Module:
    prefix = f"model.layers.{index}."
    input_norm = norm(weights, prefix + "input_layernorm.weight", config)
    post_attention_norm = norm(weights, prefix + "post_attention_layernorm.weight", config)
    if config.rotary_dim != config.head_dim:
        return Block(
            input_norm,
            attention(weights, config, prefix + "self_attn.", qkv),
            post_attention_norm,
            gated_mlp(weights, gate_up, prefix + "mlp.down_proj", config.intermediate_size),
        )
    return DecoderLayer(
        config,
        input_norm=input_norm,
        qkv=fused_linear(weights, qkv),
        o_proj=fused_linear(weights, [prefix + "self_attn.o_proj"]),
        post_attention_norm=post_attention_norm,
        gate_up=fused_linear(weights, gate_up),
        down=fused_linear(weights, [prefix + "mlp.down_proj"]),
    )


def split_projections(index: int) -> tuple[list[str], list[str]]:
    prefix = f"model.layers.{index}."
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    return [attn + "q_proj", attn + "k_proj", attn + "v_proj"], [mlp + "gate_proj", mlp + "up_proj"]


def llama_like_model(config: ModelConfig, weights: WeightBuilder, layers: list[torch.nn.Module]) -> torch.nn.Module:
    embed = weights.embedding("model.embed_tokens.weight")
    final_norm = norm(weights, "model.norm.weight", config)
    head = lm_head(weights, config, embed)
    if config.layer_windows or config.rotary_dim != config.head_dim:
        return DecoderModel(config, embed, layers, final_norm, head)
    return LlamaModel(config, embed, layers, final_norm, head)


def every_layer(window: int, num_layers: int) -> tuple[int, ...]:
    return (window,) * num_layers if window else ()


class Llama(Family):
    name, key = "Llama", "llama"
    hf_model_types = ("llama",)
    gguf_architectures = ("llama",)
    gguf_permuted_qk = True

    def matches_gguf(self, meta: Metadata) -> bool:
        return meta.arch == "llama" and not meta.arch_get("expert_count")  # Mixtral GGUFs are llama-arch too

    def config_from_hf(self, raw: dict[str, Any]) -> ModelConfig:
        return ModelConfig(**self.hf_fields(raw))

    def config_from_gguf(self, meta: Metadata, tensors: GGUFTensors) -> ModelConfig:
        fields = self.gguf_fields(meta, tensors)
        fields["layer_windows"] = every_layer(int(meta.arch_get("attention.sliding_window") or 0), fields["num_layers"])
        return ModelConfig(**fields)

    def build(self, config: ModelConfig, weights: WeightBuilder) -> torch.nn.Module:
        layers = [llama_layer(config, weights, i, *split_projections(i)) for i in weights.layer_range(config)]
        return llama_like_model(config, weights, layers)


class Mistral(Llama):
    """Mistral 7B: Llama with a sliding window on every layer where config.json sets one (v0.1: 4096).

    llama.cpp writes Mistral as a `llama` GGUF, so Mistral GGUF files load through Llama.
    """

    name, key = "Mistral", "mistral"
    hf_model_types = ("mistral",)
    gguf_architectures = ()

    def matches_gguf(self, meta: Metadata) -> bool:
        return False

    def config_from_hf(self, raw: dict[str, Any]) -> ModelConfig:
        fields = self.hf_fields(raw)
        fields["layer_windows"] = every_layer(int(raw.get("sliding_window") or 0), fields["num_layers"])
        return ModelConfig(**fields)


class Qwen2(Llama):
    """Qwen2/2.5: biases on q/k/v; a sliding window on layers >= max_window_layers when use_sliding_window."""

    name, key = "Qwen2/2.5", "qwen2"
    hf_model_types = ("qwen2",)
    gguf_architectures = ("qwen2",)
    gguf_permuted_qk = False

    def matches_gguf(self, meta: Metadata) -> bool:
        return meta.arch == "qwen2"

    def config_from_hf(self, raw: dict[str, Any]) -> ModelConfig:
        fields = self.hf_fields(raw)
        fields["attention_bias"] = True
        layers = fields["num_layers"]
        if raw.get("use_sliding_window") and raw.get("sliding_window"):
            start = int(raw.get("max_window_layers", layers))
            default = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
            fields["layer_windows"] = hf_layer_windows(raw, layers, default)
        return ModelConfig(**fields)


class Phi3(Llama):
    """Phi-3/3.5 and Phi-4-mini: q/k/v fused as qkv_proj and gate/up as gate_up_proj in the checkpoint."""

    name, key = "Phi-3", "phi3"
    hf_model_types = ("phi3",)
    gguf_architectures = ("phi3",)
    gguf_permuted_qk = False
    gguf_layer_names = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

    def matches_gguf(self, meta: Metadata) -> bool:
        return meta.arch == "phi3"

    def config_from_hf(self, raw: dict[str, Any]) -> ModelConfig:
        fields = self.hf_fields(raw)
        fields["layer_windows"] = every_layer(int(raw.get("sliding_window") or 0), fields["num_layers"])
        return ModelConfig(**fields)

    def config_from_gguf(self, meta: Metadata, tensors: GGUFTensors) -> ModelConfig:
        fields = self.gguf_fields(meta, tensors)
        fields["layer_windows"] = every_layer(int(meta.arch_get("attention.sliding_window") or 0), fields["num_layers"])
        if "rope_factors_long.weight" in tensors:
            original = int(meta.arch_get("rope.scaling.original_context_length", 0))
            fields["rope_scaling"] = RopeScaling(
                "longrope",
                factor=fields["max_context"] / original,
                original_max_position=original,
                attention_factor=meta.arch_get("rope.scaling.attn_factor"),
                short_factor=tensors.factors("rope_factors_short.weight"),
                long_factor=tensors.factors("rope_factors_long.weight"),
            )
        return ModelConfig(**fields)

    def build(self, config: ModelConfig, weights: WeightBuilder) -> torch.nn.Module:
        layers = [
            llama_layer(
                config, weights, i, [f"model.layers.{i}.self_attn.qkv_proj"], [f"model.layers.{i}.mlp.gate_up_proj"]
            )
            for i in weights.layer_range(config)
        ]
        return llama_like_model(config, weights, layers)
