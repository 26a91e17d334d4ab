"""Hyper-parameters of a Llama-family decoder, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """A rope_scaling block as HF configs declare it (`rope_type` linear, llama3 or yarn)."""

    rope_type: str
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    @classmethod
    def from_hf(cls, raw: dict[str, Any] | None) -> RopeScaling | None:
        if not raw:
            return None
        rope_type = raw.get("rope_type") or raw.get("type") or "default"
        if rope_type == "default":
            return None
        return cls(
            rope_type=rope_type,
            factor=float(raw.get("factor", 1.0)),
            original_max_position=int(raw.get("original_max_position_embeddings", 0)),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            beta_fast=float(raw.get("beta_fast", 32.0)),
            beta_slow=float(raw.get("beta_slow", 1.0)),
            attention_factor=raw.get("attention_factor"),
        )


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_context: int
    head_dim: int = 0  # 0 = hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    architecture: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "llama")
        num_heads = int(raw["num_attention_heads"])
        return cls(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            vocab_size=int(raw["vocab_size"]),
            max_context=int(raw.get("max_position_embeddings", 2048)),
            head_dim=int(raw.get("head_dim") or 0),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=RopeScaling.from_hf(raw.get("rope_scaling")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            architecture=model_type,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, in elements (multiply by the element size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
