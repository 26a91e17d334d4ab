"""Random-weight models with real shapes, for the GPU check: speed does not depend on the weights' values.

The GPU machine cannot download weights and a call cannot carry the default GGUF, so the check
builds models there from a shape (a config.json's fields) and a seed: lmq's own model through
`build_model`, and transformers' LlamaForCausalLM with the very same tensors as the reference.

Weights are scaled so that activations stay of order one through every layer and the logits
spread (standard deviation about 3): greedy choices are then rarely near-ties, which keeps the
token comparisons meaningful. The tokenizer is a word-level one with one token per id ("t0",
"t1", ...): it detokenizes every id the model can produce, which is all the engine needs.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from worker.model.build import build_model
from worker.model.chat_template import ChatTemplate
from worker.model.checkpoint import CHATML_TEMPLATE
from worker.model.config import ModelConfig
from worker.model.families import family_for_hf
from worker.model.loader import LoadedModel
from worker.model.weights import TensorSource

_COMMON = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
           "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (the default model's GGUF has the same config)
    "smollm2-135m": _COMMON | dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0),
    # meta-llama/Llama-3.2-1B-Instruct
    "llama-3.2-1b": _COMMON | dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                                   rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # tests/support/tiny_model.py's size: for dry runs on a CPU
    "tiny": _COMMON | dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=384, max_position_embeddings=512, rope_theta=10000.0),
}  # fmt: skip


def hf_config(shape: str, max_context: int | None = None) -> dict[str, Any]:
    """The shape's config.json; max_context caps max_position_embeddings (the KV budget, not the speed, depends on it)."""
    config = dict(SHAPES[shape])
    if max_context is not None:
        config["max_position_embeddings"] = min(config["max_position_embeddings"], max_context)
    return config


def random_weights(
    config: dict[str, Any], seed: int = 0, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """float32 tensors under HF names; the same seed and device give the same weights."""
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator, device=device) * std

    def norm() -> torch.Tensor:
        return 1.0 + torch.randn(hidden, generator=generator, device=device) * 0.05

    def linear(rows: int, cols: int) -> torch.Tensor:
        return normal(rows, cols, 1 / math.sqrt(cols))

    weights = {"model.embed_tokens.weight": normal(vocab, hidden, 3 / math.sqrt(hidden)), "model.norm.weight": norm()}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": linear(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
        }
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(vocab, hidden, 3 / math.sqrt(hidden))
    return weights


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """One word per id, "t<id>", split on whitespace; unknown words read as t0."""
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def model_config(config: dict[str, Any]) -> ModelConfig:
    return family_for_hf(config).config_from_hf(config)


def lmq_model(
    config: dict[str, Any], weights: dict[str, torch.Tensor], *, dtype: torch.dtype, device: str | torch.device
) -> LoadedModel:
    """lmq's model of these weights (no quantization), with what the engine needs beside it."""
    device = torch.device(device)
    parsed = model_config(config)
    sources = {
        name: TensorSource(tuple(tensor.shape), lambda tensor=tensor: tensor) for name, tensor in weights.items()
    }
    model = build_model(parsed, sources, dtype, "none", device, name="random")
    return LoadedModel(
        name="random", config=parsed, model=model, tokenizer=word_tokenizer(parsed.vocab_size),
        chat_template=ChatTemplate(CHATML_TEMPLATE, bos_token="", eos_token=""), stop_token_ids=frozenset(),
        bos_token_id=None, dtype=dtype, device=device, quant="none", path=pathlib.Path("random"),
        parameter_count=sum(tensor.numel() for tensor in weights.values()),
    )  # fmt: skip


def hf_model(
    config: dict[str, Any], weights: dict[str, torch.Tensor], *, dtype: torch.dtype, device: str | torch.device
):
    """transformers' LlamaForCausalLM holding the same weights (SDPA attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config_ = LlamaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    with torch.device(device):
        model = LlamaForCausalLM(hf_config_).to(dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    if config["tie_word_embeddings"]:
        model.tie_weights()
    return model.eval()


def write_hf_dir(
    directory: pathlib.Path,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
) -> pathlib.Path:
    """An HF model directory `lmq worker --model` loads: config.json, model.safetensors, tokenizer files."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {name: tensor.to(dtype).contiguous().cpu() for name, tensor in weights.items()},
        str(directory / "model.safetensors"),
    )
    word_tokenizer(config["vocab_size"]).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE}))
    return directory
