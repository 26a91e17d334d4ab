"""What a model family tells the loaders: how to read its config, where llama.cpp put its tensors, how to build it.

Each family is one small class in this package. The HF and GGUF loaders turn a checkpoint into a
ModelConfig and a WeightMap under the family's HF tensor names and HF layout (GGUF tensors are
renamed, un-permuted and un-shifted on the way in), so `build` sees one kind of input whichever
format the model came in.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.model.config import ModelConfig, RopeScaling, hf_common_fields
from worker.model.decoder import Attention, GatedMLP
from worker.model.embedding import TokenEmbedding
from worker.model.gguf_metadata import GGUFTensors, Metadata
from worker.model.norm import RMSNorm
from worker.model.weight_builder import WeightBuilder
from worker.model.weights import WeightMap

# llama.cpp's per-layer tensor names (blk.N.<part>) and the HF module each one comes from, as most families have them.
COMMON_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class Family:
    """One architecture family. Subclasses set the class attributes and override the readers and `build`."""

    name = ""  # as people call it, for messages and docs
    key = ""  # ModelConfig.architecture of this family's configs
    hf_model_types: tuple[str, ...] = ()  # config.json model_type values
    gguf_architectures: tuple[str, ...] = ()  # general.architecture values
    gguf_layer_names: dict[str, str] = {}  # entries added to (or replacing) COMMON_GGUF_LAYER_NAMES
    gguf_permuted_qk = False  # llama.cpp interleaves the rotary halves of q/k rows (llama-arch files)
    gguf_norm_shift = 0.0  # GGUF norm weights hold w + shift (Gemma's converter adds 1)

    def matches_gguf(self, meta: Metadata) -> bool:
        return meta.arch in self.gguf_architectures

    def layer_names(self) -> dict[str, str]:
        return {**COMMON_GGUF_LAYER_NAMES, **self.gguf_layer_names}

    def hf_fields(self, raw: dict[str, Any]) -> dict[str, Any]:
        return {**hf_common_fields(raw), "architecture": self.key}

    def gguf_fields(self, meta: Metadata, tensors: GGUFTensors) -> dict[str, Any]:
        return gguf_common_fields(meta, tensors, self.key)

    def config_from_hf(self, raw: dict[str, Any]) -> ModelConfig:
        raise NotImplementedError

    def config_from_gguf(self, meta: Metadata, tensors: GGUFTensors) -> ModelConfig:
        raise NotImplementedError

    def build(self, config: ModelConfig, weights: WeightBuilder) -> torch.nn.Module:
        raise NotImplementedError


def gguf_rope_scaling(meta: Metadata, tensors: GGUFTensors) -> RopeScaling | None:
    """rope.scaling.* metadata, or Llama 3's `rope_freqs` divisors."""
    kind = meta.arch_get("rope.scaling.type")
    original = int(meta.arch_get("rope.scaling.original_context_length", 0))
    if kind == "linear":
        return RopeScaling("linear", factor=float(meta.arch_get("rope.scaling.factor", 1.0)))
    if kind == "yarn":
        return RopeScaling(
            "yarn",
            factor=float(meta.arch_get("rope.scaling.factor", 1.0)),
            original_max_position=original,
            beta_fast=float(meta.arch_get("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(meta.arch_get("rope.scaling.yarn_beta_slow", 1.0)),
            attention_factor=meta.arch_get("rope.scaling.yarn_attn_factor"),
        )
    if kind not in (None, "none", "longrope"):
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (supported: linear, yarn, rope_freqs)")
    if "rope_freqs.weight" in tensors:
        return RopeScaling("freq_factors", freq_factors=tensors.factors("rope_freqs.weight"))
    return None


def gguf_common_fields(meta: Metadata, tensors: GGUFTensors, key: str) -> dict[str, Any]:
    """ModelConfig keyword arguments from the metadata every llama.cpp decoder has."""
    hidden = meta.arch_int("embedding_length")
    num_heads = meta.arch_int("attention.head_count")
    head_dim = meta.arch_int("attention.key_length", hidden // num_heads)
    return dict(
        hidden_size=hidden,
        intermediate_size=meta.arch_int("feed_forward_length", 0),
        num_layers=meta.arch_int("block_count"),
        num_heads=num_heads,
        num_kv_heads=meta.arch_int("attention.head_count_kv", num_heads),
        vocab_size=tensors.shape("token_embd.weight")[0],
        max_context=meta.arch_int("context_length", 2048),
        head_dim=head_dim,
        rope_theta=float(meta.arch_get("rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(meta, tensors),
        rms_norm_eps=float(meta.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        architecture=key,
        rotary_dim=meta.arch_int("rope.dimension_count", head_dim),
    )


def norm(weights: WeightBuilder, name: str, config: ModelConfig, shift: float = 0.0) -> RMSNorm:
    """An RMSNorm; shift 1.0 builds Gemma's x * (1 + w) as a plain norm with weight 1 + w."""
    weight = weights.tensor(name)
    return RMSNorm(weight + shift if shift else weight, config.rms_norm_eps)


def fused_linear(weights: WeightBuilder, modules: list[str]) -> torch.nn.Module:
    """One linear over the modules' output rows (weights `<m>.weight`, biases `<m>.bias` where present)."""
    return weights.linear([m + ".weight" for m in modules], [m + ".bias" for m in modules])


def attention(
    weights: WeightBuilder, config: ModelConfig, prefix: str, qkv_modules: list[str] | None = None, **kwargs: Any
) -> Attention:
    """q/k/v/o of `prefix` (…self_attn.), fused into one qkv linear; qkv_modules when the checkpoint fuses them."""
    qkv = fused_linear(weights, qkv_modules or [prefix + "q_proj", prefix + "k_proj", prefix + "v_proj"])
    return Attention(config, qkv, fused_linear(weights, [prefix + "o_proj"]), **kwargs)


def gated_mlp(
    weights: WeightBuilder, gate_up: list[str], down: str, intermediate_size: int, act: str = "silu"
) -> GatedMLP:
    """gate_up: the gate and up modules (or one module holding both, gate rows first)."""
    return GatedMLP(fused_linear(weights, gate_up), fused_linear(weights, [down]), intermediate_size, act)


def tied_head(config: ModelConfig, weights: WeightMap) -> bool:
    """Whether the output head is the token embedding (tied in the config, or no head of its own in the file)."""
    return config.tie_word_embeddings or "lm_head.weight" not in weights


def lm_head(weights: WeightBuilder, config: ModelConfig, embed: TokenEmbedding) -> torch.nn.Module:
    if tied_head(config, weights.weights):
        return weights.head("model.embed_tokens.weight", embed.table)
    return weights.head("lm_head.weight")
