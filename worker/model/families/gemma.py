"""Gemma 2 and Gemma 3.

What sets them apart from Llama, and where each lives:
- RMSNorm scales by (1 + w): built as a plain RMSNorm of weight 1 + w (llama.cpp's converter stores
  1 + w in the GGUF already, so the GGUF loader subtracts the shift and both formats meet here);
- embeddings multiplied by sqrt(hidden_size), rounded to the compute dtype as HF does;
- norms around both the attention and the MLP outputs (post_attention / post_feedforward);
- attention scaled by query_pre_attn_scalar^-0.5, not head_dim^-0.5;
- alternating local (sliding-window) and global layers: Gemma 2 every other layer, Gemma 3 five
  local then one global. A window is only an attention mask over the shared KV pool;
- Gemma 2: attention logits and final logits soft-capped, cap * tanh(x / cap). SDPA cannot cap its
  scores, so Gemma 2's layers pass `softcap` to paged_attention (worker/model/paged_attention.py);
- Gemma 3: per-head q/k RMSNorm, and local layers rotate with their own base (10 000) and no
  scaling while global layers use rope_theta with rope_scaling (linear 8 on the 4B and larger).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from worker.model.config import ModelConfig, hf_layer_windows, hf_rope_parameters
from worker.model.decoder import Block, DecoderModel
from worker.model.families.base import Family, attention, gated_mlp, lm_head, norm
from worker.model.gguf_metadata import GGUFTensors, Metadata
from worker.model.paged_attention import paged_attention
from worker.model.rope import Rotary
from worker.model.weight_builder import WeightBuilder


@dataclass(frozen=True)
class GemmaOptions:
    query_pre_attn_scalar: float
    attn_softcap: float | None
    final_softcap: float | None
    local_rope_theta: float
    activation: str = "gelu_pytorch_tanh"


# Gemma3TextConfig's defaults: multimodal Gemma 3 checkpoints list only what differs in text_config.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}


def _gguf_query_scalar(meta: Metadata, fields: dict[str, Any], big_layer_count: int) -> float:
    """llama.cpp has no metadata key for query_pre_attn_scalar: it uses hidden/heads for the 27B models
    (recognised by their layer count) and head_dim for the others, as Google's reference code does."""
    scale = meta.arch_get("attention.scale")
    if scale:
        return 1.0 / float(scale) ** 2
    if fields["num_layers"] == big_layer_count:
        return fields["hidden_size"] / fields["num_heads"]
    return fields["head_dim"]


class Gemma2(Family):
    name, key = "Gemma 2", "gemma2"
    hf_model_types = ("gemma2",)
    gguf_architectures = ("gemma2",)
    gguf_norm_shift = 1.0
    gguf_layer_names = {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    local_every = 2  # layers i with (i + 1) % local_every != 0 are local (sliding)
    big_layer_count = 46  # gemma-2-27b

    def default_layer_types(self, num_layers: int, every: int | None = None) -> list[str]:
        every = every or self.local_every
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]

    def config_from_hf(self, raw: dict[str, Any]) -> ModelConfig:
        fields = self.hf_fields(raw)
        default = self.default_layer_types(fields["num_layers"], raw.get("sliding_window_pattern"))
        fields["layer_windows"] = hf_layer_windows(raw, fields["num_layers"], default)
        options = GemmaOptions(
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or fields["head_dim"]),
            attn_softcap=raw.get("attn_logit_softcapping"),
            final_softcap=raw.get("final_logit_softcapping"),
            local_rope_theta=fields["rope_theta"],
            activation=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        )
        return ModelConfig(**fields, options=options)

    def config_from_gguf(self, meta: Metadata, tensors: GGUFTensors) -> ModelConfig:
        fields = self.gguf_fields(meta, tensors)
        fields["layer_windows"] = self.gguf_windows(
            meta, fields["num_layers"], default=4096
        )  # llama.cpp's Gemma 2 default
        options = GemmaOptions(
            query_pre_attn_scalar=_gguf_query_scalar(meta, fields, self.big_layer_count),
            attn_softcap=float(meta.arch_get("attn_logit_softcapping", 50.0)),
            final_softcap=float(meta.arch_get("final_logit_softcapping", 30.0)),
            local_rope_theta=fields["rope_theta"],
        )
        return ModelConfig(**fields, options=options)

    def gguf_windows(self, meta: Metadata, num_layers: int, default: int) -> tuple[int, ...]:
        window = int(meta.arch_get("attention.sliding_window", default) or 0)
        return hf_layer_windows({"sliding_window": window}, num_layers, self.default_layer_types(num_layers))

    def attend(self, config: ModelConfig) -> Any:
        options: GemmaOptions = config.options
        scale = options.query_pre_attn_scalar**-0.5
        if options.attn_softcap:
            return functools.partial(paged_attention, scale=scale, softcap=float(options.attn_softcap))
        return functools.partial(paged_attention, scale=scale)

    def qk_norms(self, config: ModelConfig, weights: WeightBuilder, attn: str) -> dict[str, Any]:
        return {}

    def layer(self, config: ModelConfig, weights: WeightBuilder, index: int) -> Block:
        prefix = f"model.layers.{index}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        gate_up, down = [mlp + "gate_proj", mlp + "up_proj"], mlp + "down_proj"
        return Block(
            norm(weights, prefix + "input_layernorm.weight", config, shift=1.0),
            attention(weights, config, attn, attend=self.attend(config), **self.qk_norms(config, weights, attn)),
            norm(weights, prefix + "pre_feedforward_layernorm.weight", config, shift=1.0),
            gated_mlp(weights, gate_up, down, config.intermediate_size, config.options.activation),
            post_attention_norm=norm(weights, prefix + "post_attention_layernorm.weight", config, shift=1.0),
            post_mlp_norm=norm(weights, prefix + "post_feedforward_layernorm.weight", config, shift=1.0),
        )

    def rotaries(self, config: ModelConfig) -> tuple[list[Rotary], list[int]]:
        return [Rotary(config)], [0] * config.num_layers

    def build(self, config: ModelConfig, weights: WeightBuilder) -> torch.nn.Module:
        layers = [self.layer(config, weights, i) for i in weights.layer_range(config)]
        embed = weights.embedding("model.embed_tokens.weight")
        rotaries, layer_rotary = self.rotaries(config)
        return DecoderModel(
            config,
            embed,
            layers,
            norm(weights, "model.norm.weight", config, shift=1.0),
            lm_head(weights, config, embed),
            rotaries=rotaries,
            layer_rotary=layer_rotary,
            embed_scale=math.sqrt(config.hidden_size),
            final_softcap=config.options.final_softcap,
        )


class Gemma3(Gemma2):
    name, key = "Gemma 3", "gemma3"
    hf_model_types = ("gemma3", "gemma3_text")
    gguf_architectures = ("gemma3",)
    local_every = 6
    big_layer_count = 62  # gemma-3-27b

    def config_from_hf(self, raw: dict[str, Any]) -> ModelConfig:
        raw = {**GEMMA3_TEXT_DEFAULTS, **raw.get("text_config", raw)}  # multimodal checkpoints nest the text model
        if "rope_parameters" in raw:  # transformers 5: one rope block per layer type
            raw.pop("rope_theta"), raw.pop("rope_local_base_freq")
            local_theta = float(hf_rope_parameters(raw, "sliding_attention")["rope_theta"])
        else:
            local_theta = float(raw["rope_local_base_freq"])
        config = super().config_from_hf(raw)
        return replace(config, options=replace(config.options, local_rope_theta=local_theta))

    def config_from_gguf(self, meta: Metadata, tensors: GGUFTensors) -> ModelConfig:
        fields = self.gguf_fields(meta, tensors)
        fields["layer_windows"] = self.gguf_windows(meta, fields["num_layers"], default=0)  # no key: no local layers
        softcap = meta.arch_get("final_logit_softcapping")
        options = GemmaOptions(
            query_pre_attn_scalar=_gguf_query_scalar(meta, fields, self.big_layer_count),
            attn_softcap=None,
            final_softcap=float(softcap) if softcap else None,
            local_rope_theta=float(meta.arch_get("rope.freq_base_swa", 10_000.0)),
        )
        return ModelConfig(**fields, options=options)

    def qk_norms(self, config: ModelConfig, weights: WeightBuilder, attn: str) -> dict[str, Any]:
        return {
            "q_norm": norm(weights, attn + "q_norm.weight", config, shift=1.0),
            "k_norm": norm(weights, attn + "k_norm.weight", config, shift=1.0),
        }

    def rotaries(self, config: ModelConfig) -> tuple[list[Rotary], list[int]]:
        """Global layers: rope_theta with rope_scaling; local (windowed) layers: their own base, unscaled."""
        rotaries = [Rotary(config), Rotary(config, theta=config.options.local_rope_theta, scaling=None)]
        return rotaries, [1 if config.window(i) else 0 for i in range(config.num_layers)]
