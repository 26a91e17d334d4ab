"""Hugging Face model directories: config.json, *.safetensors (one file or a sharded index), tokenizer files.

The family comes from config.json's model_type; a quantized checkpoint (quantization_config: GPTQ,
AWQ, FP8, …) or a tensor dtype other than float32/float16/bfloat16 is refused before any weight
is read. Multimodal checkpoints (Gemma 3) contribute their language model: its tensors are renamed
to the text-only names and the vision tower is left on disk.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from worker.model.checkpoint import CHATML_TEMPLATE, Checkpoint
from worker.model.families import UnsupportedModel, family_for_hf
from worker.model.weights import TensorSource, WeightMap

FLOAT_DTYPES = {"F32", "F16", "BF16"}
# Language-model prefixes of multimodal checkpoints (transformers 4 and 5 layouts) -> text-only names
TEXT_MODEL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
NOT_TEXT_MODEL = ("vision_tower", "multi_modal_projector", "vision_model", "audio_tower")


def _weight_files(directory: pathlib.Path) -> list[pathlib.Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    return files


def _loader(path: pathlib.Path, name: str) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(name).float()

    return load


def text_model_name(name: str) -> str:
    for prefix, replacement in TEXT_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name


def _weights(directory: pathlib.Path) -> WeightMap:
    weights: WeightMap = {}
    for path in _weight_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if any(part in name for part in NOT_TEXT_MODEL):
                    continue
                tensor = handle.get_slice(name)
                if tensor.get_dtype() not in FLOAT_DTYPES:
                    raise UnsupportedModel(
                        f"{path.name}: tensor {name} has dtype {tensor.get_dtype()}, which lmq cannot load"
                    )
                weights[text_model_name(name)] = TensorSource(shape=tuple(tensor.get_shape()), load=_loader(path, name))
    return weights


def _read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_string(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _eos_token_ids(directory: pathlib.Path, tokenizer: Tokenizer, tokenizer_config: dict) -> list[int]:
    ids: list[int] = []
    eos_token = _token_string(tokenizer_config.get("eos_token"))
    if eos_token and tokenizer.token_to_id(eos_token) is not None:
        ids.append(tokenizer.token_to_id(eos_token))
    for config_file in ("generation_config.json", "config.json"):
        declared = _read_json(directory / config_file).get("eos_token_id")
        ids.extend(declared if isinstance(declared, list) else [declared] if declared is not None else [])
    return list(dict.fromkeys(ids))


def chat_template_source(directory: pathlib.Path, tokenizer_config: dict) -> str:
    """tokenizer_config.json's chat_template (a string, or named templates: "default" wins),
    else chat_template.jinja or chat_template.json beside it (newer checkpoints), else ChatML."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default") or next(iter(named.values()), None)
    if not template and (directory / "chat_template.jinja").exists():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if not template:
        template = _read_json(directory / "chat_template.json").get("chat_template")
    return template or CHATML_TEMPLATE


def _config(directory: pathlib.Path) -> dict[str, Any]:
    raw = _read_json(directory / "config.json")
    quantization = raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "unknown")
        raise UnsupportedModel(
            f"{directory.name}: quantized checkpoints ({method}) are not supported; use the float weights or a GGUF"
        )
    return raw


def read_hf_checkpoint(directory: pathlib.Path) -> Checkpoint:
    raw = _config(directory)
    family = family_for_hf(raw)
    config = family.config_from_hf(raw)
    if not (directory / "tokenizer.json").exists():
        raise UnsupportedModel(
            f"{directory}: no tokenizer.json (a SentencePiece tokenizer.model alone is not supported)"
        )
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    return Checkpoint(
        name=directory.resolve().name,
        config=config,
        weights=_weights(directory),
        tokenizer=tokenizer,
        chat_template=chat_template_source(directory, tokenizer_config),
        bos_token=_token_string(tokenizer_config.get("bos_token")),
        eos_token_ids=_eos_token_ids(directory, tokenizer, tokenizer_config),
    )
