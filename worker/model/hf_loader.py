"""Hugging Face model directories: config.json, *.safetensors (one file or a sharded index), tokenizer files."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from worker.model.checkpoint import CHATML_TEMPLATE, Checkpoint
from worker.model.config import ModelConfig
from worker.model.weights import TensorSource, WeightMap


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


def _weights(directory: pathlib.Path) -> WeightMap:
    weights: WeightMap = {}
    for path in _weight_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                shape = tuple(handle.get_slice(name).get_shape())
                weights[name] = TensorSource(shape=shape, load=_loader(path, name))
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


def read_hf_checkpoint(directory: pathlib.Path) -> Checkpoint:
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    return Checkpoint(
        name=directory.resolve().name,
        config=ModelConfig.from_hf(_read_json(directory / "config.json")),
        weights=_weights(directory),
        tokenizer=tokenizer,
        chat_template=tokenizer_config.get("chat_template") or CHATML_TEMPLATE,
        bos_token=_token_string(tokenizer_config.get("bos_token")),
        eos_token_ids=_eos_token_ids(directory, tokenizer, tokenizer_config),
    )
