"""The model families lmq runs, and the refusal for everything else.

A checkpoint names its family (config.json `model_type`, GGUF `general.architecture`); the loaders
look it up here before reading any weight, so an unsupported model fails with its name and the
list of supported ones rather than after gigabytes are allocated.
"""

from __future__ import annotations

from typing import Any

from worker.model.families.base import Family
from worker.model.families.gemma import Gemma2, Gemma3
from worker.model.families.llama import Llama, Mistral, Phi3, Qwen2
from worker.model.families.mixtral import Mixtral
from worker.model.families.qwen3 import Qwen3, Qwen3Moe
from worker.model.gguf_metadata import Metadata

FAMILIES: tuple[Family, ...] = (Llama(), Mistral(), Qwen2(), Qwen3(), Qwen3Moe(), Gemma2(), Gemma3(), Phi3(), Mixtral())


class UnsupportedModel(ValueError):
    """The checkpoint's architecture, tensor type or setting is one lmq does not run."""


def supported_hf_types() -> list[str]:
    return [model_type for family in FAMILIES for model_type in family.hf_model_types]


def supported_gguf_architectures() -> list[str]:
    return sorted({arch for family in FAMILIES for arch in family.gguf_architectures})


def family_for_hf(raw_config: dict[str, Any]) -> Family:
    model_type = raw_config.get("model_type", "llama")  # the oldest Llama conversions have none
    for family in FAMILIES:
        if model_type in family.hf_model_types:
            return family
    names = raw_config.get("architectures") or []
    shown = f"{model_type!r}" + (f" ({', '.join(names)})" if names else "")
    raise UnsupportedModel(f"model_type {shown} is not supported (supported: {', '.join(supported_hf_types())})")


def family_for_gguf(meta: Metadata) -> Family:
    for family in FAMILIES:
        if family.matches_gguf(meta):
            return family
    raise UnsupportedModel(
        f"GGUF architecture {meta.arch!r} is not supported (supported: {', '.join(supported_gguf_architectures())})"
    )


def family_by_key(key: str) -> Family:
    for family in FAMILIES:
        if family.key == key:
            return family
    raise UnsupportedModel(f"no model family {key!r}")
