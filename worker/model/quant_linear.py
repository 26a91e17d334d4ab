"""Linear layers for the weight modes: dense (F.linear), int8 per output channel, int4 in groups of 32.

int8 runs on `aten._weight_int8pack_mm`, int4 on `aten._weight_int4pack_mm_for_cpu` (CPU only);
activations stay in the compute dtype (float32 or bfloat16) in every mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.model.weights import INT4_GROUP, Int4Blocks


class DenseLinear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int8Linear(torch.nn.Module):
    """Symmetric int8 weights with one scale per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        weight = weight.float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.qweight, self.scale)
        out = out.view(*x.shape[:-1], -1)
        return out if self.bias is None else out + self.bias


def quantize_int4(weight: torch.Tensor) -> Int4Blocks:
    """Asymmetric min/max quantization of float weights [N, K] to 4 bits per group of INT4_GROUP."""
    n, k = weight.shape
    groups = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    return Int4Blocks(q=q.view(n, k).to(torch.uint8), scale=scale, zero=low + 8 * scale)


def int4_supported(weight_shape: torch.Size | tuple[int, ...], device: torch.device) -> bool:
    """The CPU kernel wants N a multiple of 16 and K of the group size."""
    return device.type == "cpu" and weight_shape[0] % 16 == 0 and weight_shape[1] % INT4_GROUP == 0


class Int4Linear(torch.nn.Module):
    def __init__(self, blocks: Int4Blocks, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features = blocks.q.shape[0]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32), 1)
        scale_and_zero = torch.stack((blocks.scale, blocks.zero), dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scale_and_zero", scale_and_zero.to(dtype))  # [K // group, N, 2]
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scale_and_zero)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias
