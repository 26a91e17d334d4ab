"""Assemble a LlamaModel from HF-named tensor sources in the chosen dtype and weight mode."""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from worker.model.config import ModelConfig
from worker.model.llama import DecoderLayer, LlamaModel, RMSNorm
from worker.model.quant_linear import DenseLinear, Int4Linear, Int8Linear, int4_supported, quantize_int4
from worker.model.weights import Int4Blocks, WeightMap

log = logging.getLogger(__name__)


class WeightBuilder:
    def __init__(self, weights: WeightMap, dtype: torch.dtype, quant: str, device: torch.device) -> None:
        self.weights, self.dtype, self.quant, self.device = weights, dtype, quant, device

    def tensor(self, name: str) -> torch.Tensor:
        return self.weights[name].load().to(device=self.device, dtype=self.dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.tensor(name) if name in self.weights else None

    def linear(self, names: list[str], bias_names: list[str] | None = None) -> torch.nn.Module:
        """One linear over the concatenated output rows of `names` (fuses q/k/v and gate/up)."""
        sources = [self.weights[name] for name in names]
        bias = self._bias(bias_names)
        shape = (sum(source.shape[0] for source in sources), sources[0].shape[1])
        if self.quant == "int4" and int4_supported(shape, self.device):
            blocks = Int4Blocks.cat([source.int4() or quantize_int4(source.load()) for source in sources])
            return Int4Linear(blocks, bias, self.dtype)
        weight = torch.cat([source.load() for source in sources])
        if self.quant in ("int8", "int4"):
            return Int8Linear(weight, bias, self.dtype).to(self.device)
        return DenseLinear(weight.to(device=self.device, dtype=self.dtype), bias)

    def _bias(self, names: list[str] | None) -> torch.Tensor | None:
        if not names or names[0] not in self.weights:
            return None
        return torch.cat([self.tensor(name) for name in names])


def _layer(config: ModelConfig, build: WeightBuilder, index: int) -> DecoderLayer:
    prefix = f"model.layers.{index}."
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    projections = [attn + "q_proj", attn + "k_proj", attn + "v_proj"]
    return DecoderLayer(
        config,
        input_norm=RMSNorm(build.tensor(prefix + "input_layernorm.weight"), config.rms_norm_eps),
        qkv=build.linear([p + ".weight" for p in projections], [p + ".bias" for p in projections]),
        o_proj=build.linear([attn + "o_proj.weight"]),
        post_attention_norm=RMSNorm(build.tensor(prefix + "post_attention_layernorm.weight"), config.rms_norm_eps),
        gate_up=build.linear([mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
        down=build.linear([mlp + "down_proj.weight"]),
    )


def build_model(
    config: ModelConfig, weights: WeightMap, dtype: torch.dtype, quant: str, device: torch.device, name: str = ""
) -> LlamaModel:
    """quant: none, int8 or int4 (int4 falls back to int8 for shapes its kernel cannot take)."""
    build = WeightBuilder(weights, dtype, quant, device)
    embed = build.tensor("model.embed_tokens.weight")
    # disable=None: a progress bar only on a terminal, never `\r` lines in a log file
    layers = [_layer(config, build, i) for i in tqdm(range(config.num_layers), desc=f"loading {name}", unit="layer", disable=None)]
    if config.tie_word_embeddings or "lm_head.weight" not in weights:
        lm_head = DenseLinear(embed, None)
    else:
        lm_head = DenseLinear(build.tensor("lm_head.weight"), None)
    norm = RMSNorm(build.tensor("model.norm.weight"), config.rms_norm_eps)
    return LlamaModel(config, embed, layers, norm, lm_head).to(device).eval()
