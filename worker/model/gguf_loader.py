"""GGUF files through the `gguf` package: hyper-parameters, tokenizer, chat template and tensors under HF names.

The family (from general.architecture) says how llama.cpp renamed and transformed its tensors;
this module undoes that lazily, per tensor: the rotary-half interleaving of q/k rows in llama-arch
files, Gemma's +1 on norm weights, experts stacked into one 3-D tensor per layer. Everything that can
refuse the file (architecture, tensor types, tokenizer) is checked before any weight is read.
"""

from __future__ import annotations

import functools
import pathlib
import re

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import _type_traits

from worker.model.checkpoint import CHATML_TEMPLATE, Checkpoint
from worker.model.config import ModelConfig
from worker.model.families import UnsupportedModel, family_for_gguf
from worker.model.families.base import COMMON_GGUF_LAYER_NAMES, GGUF_GLOBAL_NAMES, Family
from worker.model.gguf_blocks import gguf_blocks
from worker.model.gguf_metadata import GGUFTensors, Metadata, dequantized, tensor_shape
from worker.model.gguf_reader import FastArraysReader
from worker.model.gguf_tokenizer import build_gguf_tokenizer
from worker.model.weights import Int4Blocks, QuantBlocks, TensorSource, WeightMap
from worker.runtime.freed_memory import drop_mapped_pages

GLOBAL_NAMES = GGUF_GLOBAL_NAMES
LAYER_NAMES = COMMON_GGUF_LAYER_NAMES  # the llama table (tests invert it to write llama GGUFs)
QUANT_SUFFIX = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)
READABLE_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def hf_name(gguf_name: str, layer_names: dict[str, str] = LAYER_NAMES) -> str | None:
    """The HF name of a GGUF tensor; expert tensors keep an "{e}" for the expert index."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match is None or match.group(2) not in layer_names:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{layer_names[part]}.{kind}"


def _unpermute_rows(rows: int, num_heads: int) -> torch.Tensor:
    """llama.cpp interleaves each head's rotary halves; this row order restores HF's [first half, second half]."""
    half = rows // num_heads // 2
    return torch.arange(rows).view(num_heads, half, 2).transpose(1, 2).reshape(-1)


def _source(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], row_order: torch.Tensor | None, shift: float
) -> TensorSource:
    def load() -> torch.Tensor:
        values = dequantized(raw, qtype, shape)
        values = values - shift if shift else values
        return values if row_order is None else values[row_order]

    def blocks() -> QuantBlocks | None:
        if len(shape) != 2:
            return None
        found = gguf_blocks(raw, qtype, shape[0], shape[1])
        return found if found is None or row_order is None else found.rows(row_order)

    def int4() -> Int4Blocks | None:
        found = blocks()
        return None if found is None else found.int4()

    def file_rows() -> np.ndarray | None:
        return raw if row_order is None and not shift and len(shape) == 2 else None

    def load_rows(start: int, stop: int) -> torch.Tensor:
        part = raw[start:stop]
        values = dequantized(part, qtype, (len(part), shape[1]))
        return values - shift if shift else values

    by_rows = row_order is None and len(shape) == 2 and raw.ndim == 2  # else TensorSource.rows slices load()
    return TensorSource(
        shape=shape, load=load, int4=int4, blocks=blocks, qtype=qtype.name, file_rows=file_rows,
        load_rows=load_rows if by_rows else None,
    )  # fmt: skip


def _check_types(reader: GGUFReader, path: pathlib.Path) -> None:
    for tensor in reader.tensors:
        qtype = GGMLQuantizationType(tensor.tensor_type)
        if qtype not in READABLE_TYPES:
            raise UnsupportedModel(f"{path}: tensor {tensor.name} has type {qtype.name}, which lmq cannot read")


def _weights(tensors: GGUFTensors, family: Family, config: ModelConfig) -> WeightMap:
    weights: WeightMap = {}
    layer_names = family.layer_names()
    for tensor in tensors.by_name.values():
        name = hf_name(tensor.name, layer_names)
        if name is None:
            continue
        qtype, shape = GGMLQuantizationType(tensor.tensor_type), tensor_shape(tensor)
        shift = family.gguf_norm_shift if tensor.name.endswith("norm.weight") else 0.0
        if "{e}" in name:  # experts stacked [experts, rows, columns]: one source per expert
            for expert in range(shape[0]):
                weights[name.format(e=expert)] = _source(tensor.data[expert], qtype, shape[1:], None, 0.0)
            continue
        row_order = None
        if family.gguf_permuted_qk and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            row_order = _unpermute_rows(shape[0], heads)
        weights[name] = _source(tensor.data, qtype, shape, row_order, shift)
    return weights


def model_name(path: pathlib.Path) -> str:
    return QUANT_SUFFIX.sub("", path.stem)


def read_gguf_checkpoint(path: pathlib.Path) -> Checkpoint:
    reader = FastArraysReader(str(path))
    meta = Metadata(reader)
    family = family_for_gguf(meta)
    _check_types(reader, path)
    tokenizer = build_gguf_tokenizer(meta.get)
    tensors = GGUFTensors(reader)
    config = family.config_from_gguf(meta, tensors)
    tokens = meta.get("tokenizer.ggml.tokens")
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [meta.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    return Checkpoint(
        name=model_name(path),
        config=config,
        weights=_weights(tensors, family, config),
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template") or CHATML_TEMPLATE,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token_ids=list(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        release_file_pages=functools.partial(drop_mapped_pages, reader.data),
    )
