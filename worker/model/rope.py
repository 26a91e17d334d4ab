"""Rotary position embeddings (HF "rotate half" layout) with the rope-scaling variants of Llama 3 and YaRN."""

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


def _attention_factor(scaling: RopeScaling | None) -> float:
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    theta = config.rope_theta
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, theta, dim)
    raise ValueError(f"unsupported rope_scaling type {scaling.rope_type!r} (supported: linear, llama3, yarn)")


class Rotary(torch.nn.Module):
    """Computes cos/sin for a step's positions once; every layer applies them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(config).float(), persistent=False)
        self.attention_factor = _attention_factor(config.rope_scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [T, 1, head_dim] for broadcasting over heads."""
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
