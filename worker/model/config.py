"""Hyper-parameters of a decoder, read from an HF config.json or GGUF metadata.

ModelConfig holds what every family shares and what the engine reads (layers, KV heads, head dim,
vocabulary, context). What only one family has (Gemma's soft-caps, a mixture of experts) travels in
`options`, a frozen dataclass that family defines: the engine never looks inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HF_ROPE_TYPES = ("linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """A rope_scaling block as HF configs declare it, or its GGUF equivalent.

    rope_type: linear, llama3, yarn, longrope, or freq_factors (GGUF `rope_freqs`: each frequency
    divided by its factor, which is how llama.cpp stores Llama 3's scaling).
    """

    rope_type: str
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope
    freq_factors: tuple[float, ...] = ()  # freq_factors

    @classmethod
    def from_hf(cls, raw: dict[str, Any] | None, max_position: int = 0) -> RopeScaling | None:
        if not raw:
            return None
        rope_type = raw.get("rope_type") or raw.get("type") or "default"
        if rope_type == "default":
            return None
        if rope_type == "su":  # Phi-3's name for longrope
            rope_type = "longrope"
        if rope_type not in HF_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(HF_ROPE_TYPES)})"
            )
        original = int(raw.get("original_max_position_embeddings") or max_position)
        factor = raw.get("factor")
        if factor is None and original:
            factor = max_position / original
        return cls(
            rope_type=rope_type,
            factor=float(factor if factor is not None else 1.0),
            original_max_position=original,
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            beta_fast=float(raw.get("beta_fast") or 32.0),
            beta_slow=float(raw.get("beta_slow") or 1.0),
            attention_factor=raw.get("attention_factor"),
            short_factor=tuple(float(x) for x in raw.get("short_factor") or ()),
            long_factor=tuple(float(x) for x in raw.get("long_factor") or ()),
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
    # Sliding-window attention, per layer: the number of most recent keys a query sees, 0 = all.
    # Empty: every layer attends to the whole context.
    layer_windows: tuple[int, ...] = ()
    rotary_dim: int = 0  # 0 = head_dim; less rotates only the first rotary_dim dims of each head
    options: Any = None  # the family's own hyper-parameters (a frozen dataclass), None for most
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.layer_windows and not any(self.layer_windows):
            object.__setattr__(self, "layer_windows", ())

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """A Llama-style config.json (the fields every family shares); families add their own."""
        return cls(**hf_common_fields(raw))


def hf_rope_parameters(raw: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """The rope block of a config.json in either layout: transformers 4 (`rope_theta` + `rope_scaling`)
    or transformers 5 (`rope_parameters`, possibly one per layer type)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]
    elif isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        params = None
    merged: dict[str, Any] = dict(raw.get("rope_scaling") or {}) if layer_type == "full_attention" else {}
    merged.update(params or {})
    merged.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "original_max_position_embeddings" in raw:  # Phi-3 keeps it outside the rope block
        merged.setdefault("original_max_position_embeddings", raw["original_max_position_embeddings"])
    return merged


def hf_common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments from the fields that Llama-style config.json files share."""
    num_heads = int(raw["num_attention_heads"])
    max_position = int(raw.get("max_position_embeddings", 2048))
    rope = hf_rope_parameters(raw)
    head_dim = int(raw.get("head_dim") or 0) or int(raw["hidden_size"]) // num_heads
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0)
    return dict(
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw.get("intermediate_size") or 0),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        vocab_size=int(raw["vocab_size"]),
        max_context=max_position,
        head_dim=head_dim,
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=RopeScaling.from_hf(rope, max_position),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        architecture=raw.get("model_type", "llama"),
        rotary_dim=int(head_dim * partial),
    )


def hf_layer_windows(raw: dict[str, Any], num_layers: int, default_types: list[str] | None = None) -> tuple[int, ...]:
    """Per-layer sliding windows from `layer_types` (or the family's default pattern) and `sliding_window`."""
    window = int(raw.get("sliding_window") or 0)
    if not window:
        return ()
    layer_types = raw.get("layer_types") or default_types or ["sliding_attention"] * num_layers
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
