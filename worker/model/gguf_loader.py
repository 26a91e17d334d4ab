"""GGUF files through the `gguf` package: hyper-parameters, tokenizer, chat template and tensors under HF names."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from worker.model.checkpoint import CHATML_TEMPLATE, Checkpoint
from worker.model.config import ModelConfig, RopeScaling
from worker.model.gguf_int4 import gguf_int4_blocks
from worker.model.gguf_tokenizer import build_gguf_tokenizer
from worker.model.weights import Int4Blocks, TensorSource, WeightMap

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
QUANT_SUFFIX = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match is None or match.group(2) not in LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"


class Metadata:
    def __init__(self, reader: GGUFReader) -> None:
        self.fields = reader.fields
        self.arch = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)


def _rope_scaling(meta: Metadata) -> RopeScaling | None:
    kind = meta.arch_get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    return RopeScaling(
        rope_type=kind,
        factor=float(meta.arch_get("rope.scaling.factor", 1.0)),
        original_max_position=int(meta.arch_get("rope.scaling.original_context_length", 0)),
    )


def _config(meta: Metadata, tensor_names: set[str], vocab_size: int) -> ModelConfig:
    num_heads = int(meta.arch_get("attention.head_count"))
    return ModelConfig(
        hidden_size=int(meta.arch_get("embedding_length")),
        intermediate_size=int(meta.arch_get("feed_forward_length")),
        num_layers=int(meta.arch_get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.arch_get("attention.head_count_kv", num_heads)),
        vocab_size=int(meta.arch_get("vocab_size", vocab_size)),
        max_context=int(meta.arch_get("context_length", 2048)),
        head_dim=int(meta.arch_get("attention.key_length", 0)),
        rope_theta=float(meta.arch_get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta),
        rms_norm_eps=float(meta.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        architecture=meta.arch,
    )


def _unpermute_rows(rows: int, num_heads: int) -> torch.Tensor:
    """llama.cpp interleaves each head's rotary halves; this row order restores HF's [first half, second half]."""
    half = rows // num_heads // 2
    return torch.arange(rows).view(num_heads, half, 2).transpose(1, 2).reshape(-1)


def _source(tensor: ReaderTensor, row_order: torch.Tensor | None) -> TensorSource:
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if len(shape) == 2 and shape[0] == 1 and tensor.data.ndim == 1:
        shape = shape[1:]

    def load() -> torch.Tensor:
        values = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        values = values.reshape(shape)
        return values if row_order is None else values[row_order]

    def int4() -> Int4Blocks | None:
        if len(shape) != 2:
            return None
        blocks = gguf_int4_blocks(tensor.data, GGMLQuantizationType(tensor.tensor_type), shape[0], shape[1])
        return blocks if blocks is None or row_order is None else blocks.rows(row_order)

    return TensorSource(shape=shape, load=load, int4=int4)


def _weights(reader: GGUFReader, config: ModelConfig) -> WeightMap:
    weights: WeightMap = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        row_order = None
        if config.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            row_order = _unpermute_rows(int(tensor.shape[-1]), heads)
        weights[name] = _source(tensor, row_order)
    return weights


def model_name(path: pathlib.Path) -> str:
    return QUANT_SUFFIX.sub("", path.stem)


def read_gguf_checkpoint(path: pathlib.Path) -> Checkpoint:
    reader = GGUFReader(str(path))
    meta = Metadata(reader)
    if meta.arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: architecture {meta.arch!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})")
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{path}: only byte-level BPE ('gpt2') GGUF tokenizers are supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    tokenizer = build_gguf_tokenizer(
        tokens, meta.get("tokenizer.ggml.merges", []), meta.get("tokenizer.ggml.token_type", []), meta.get("tokenizer.ggml.pre", "gpt2")
    )
    config = _config(meta, {tensor.name for tensor in reader.tensors}, len(tokens))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [meta.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    return Checkpoint(
        name=model_name(path),
        config=config,
        weights=_weights(reader, config),
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template") or CHATML_TEMPLATE,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token_ids=[int(i) for i in eos_ids if i is not None],
    )
