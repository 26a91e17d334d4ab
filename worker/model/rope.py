"""Rotary position embeddings (HF "rotate half" layout) with the rope-scaling variants families use.

linear (Gemma 3 global layers), llama3 (Llama 3.1+), yarn (Qwen 2.5/3 long context), longrope
(Phi-3 128k, Phi-3.5) and freq_factors (the per-frequency divisors GGUF files store for llama3
and longrope). Long-rope picks its long factors when the served context exceeds the original
one, once for the model, as llama.cpp does: every sequence then shares one rotation, so a cached
key never needs re-rotating when a sequence grows past the original context.
"""

from __future__ import annotations

import math

import torch

from worker.model.config import ModelConfig, RopeScaling


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling, theta: float, dim: int) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
    extrapolation = 1 - ramp.clamp(0, 1)
    return inv_freq / scaling.factor * (1 - extrapolation) + inv_freq * extrapolation


def _uses_long_factors(scaling: RopeScaling, max_context: int) -> bool:
    return max_context > scaling.original_max_position


def _longrope_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling, max_context: int) -> torch.Tensor:
    factors = scaling.long_factor if _uses_long_factors(scaling, max_context) else scaling.short_factor
    return inv_freq / torch.tensor(factors, dtype=torch.float64)


def attention_factor(scaling: RopeScaling | None, max_context: int) -> float:
    """The factor cos and sin are multiplied by (YaRN's and long-rope's attention temperature)."""
    if scaling is None or scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.factor <= 1:
        return 1.0
    if scaling.rope_type == "yarn":
        return 0.1 * math.log(scaling.factor) + 1.0
    return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_position))


def rotary_inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None, max_context: int) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, theta, dim)
    if scaling.rope_type == "longrope":
        return _longrope_inv_freq(inv_freq, scaling, max_context)
    if scaling.rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float64)
    raise ValueError(f"unsupported rope_scaling type {scaling.rope_type!r} (supported: linear, llama3, yarn, longrope)")


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    return rotary_inverse_frequencies(config.rotary_dim, config.rope_theta, config.rope_scaling, config.max_context)


class Rotary(torch.nn.Module):
    """Computes cos/sin for a step's positions once; every layer applies them."""

    def __init__(
        self, config: ModelConfig, theta: float | None = None, scaling: RopeScaling | None | str = "config"
    ) -> None:
        """theta/scaling override the config's (Gemma 3's local layers: their own base, no scaling)."""
        super().__init__()
        scaling = config.rope_scaling if scaling == "config" else scaling
        theta = config.rope_theta if theta is None else theta
        inv_freq = rotary_inverse_frequencies(config.rotary_dim, theta, scaling, config.max_context)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_factor = attention_factor(scaling, config.max_context)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [T, 1, rotary_dim] for broadcasting over heads."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        cos = angles.cos() * self.attention_factor
        sin = angles.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first cos.shape[-1] dims of each head and passes the rest through (Phi-4-mini)."""
    rotary_dim = cos.shape[-1]
    return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
