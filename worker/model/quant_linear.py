"""Linear layers for the weight modes: dense (F.linear), int8 per output channel, int4 in groups of 32.

int8 runs on `aten._weight_int8pack_mm`, int4 on `aten._weight_int4pack_mm_for_cpu` (CPU only);
activations stay in the compute dtype (float32 or bfloat16) in every mode.

The CPU's `auto` mode (worker/model/loader.py) adds two: `PackedLinear`, dense weights laid
out once for oneDNN (AMX or AVX-512 bf16; the same results as F.linear, 1.5-2x faster on the Intel
machine), and `TieredLinear`, which runs a step on quantized weights when it has few rows and on a
packed dense copy of the same weights when it has many. The int4 and int8 kernels dequantize their
weights again for every few rows, so their cost grows with the rows; a dense GEMM reads its weights
once for any number of rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.model.weights import INT4_GROUP, Int4Blocks, TableRows

QUANTIZE_ROWS = 8192  # rows Int8Linear quantizes at a time


class DenseLinear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int8Linear(torch.nn.Module):
    """Symmetric int8 weights with one scale per output channel, from a weight tensor or a table read by rows."""

    def __init__(self, weight: torch.Tensor | TableRows, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
        qweight = torch.empty(weight.shape, dtype=torch.int8, device=device)
        scale = torch.empty(weight.shape[0], dtype=torch.float32, device=device)
        # Rows at a time: a whole head's float32 temporaries (Gemma 3's 262144 x 640: 671 MB each) set the load's peak.
        for rows in range(0, weight.shape[0], QUANTIZE_ROWS):
            part = weight[rows : rows + QUANTIZE_ROWS].float()
            part_scale = part.abs().amax(dim=1).clamp(min=1e-12) / 127
            qweight[rows : rows + QUANTIZE_ROWS] = torch.round(part / part_scale[:, None]).clamp(-127, 127)
            scale[rows : rows + QUANTIZE_ROWS] = part_scale
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.qweight, self.scale)
        out = out.view(*x.shape[:-1], self.qweight.shape[0])  # not -1: a step may ask for zero rows
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


class PackedLinear(torch.nn.Module):
    """Dense weights reordered once into oneDNN's blocked layout (CPU): what F.linear does, without the per-call reorder."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, expected_rows: int = 16) -> None:
        super().__init__()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, expected_rows))
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packed_linear_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack weights of `dtype` here: float32 on any CPU, bfloat16 only where it has a bfloat16
    path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU such as AMD Zen 3 its reorder raises)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_packs_bfloat16())


def onednn_packs_bfloat16() -> bool:
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module:
    """Dense weights packed for oneDNN where it can pack them, else as they are (the same results as F.linear)."""
    if packed_linear_supported(weight.device, weight.dtype):
        return PackedLinear(weight, bias)
    return DenseLinear(weight, bias)


class TieredLinear(torch.nn.Module):
    """`small` (quantized) for inputs of fewer than `dense_from_rows` rows, `dense` (packed) for the others.

    `dense` holds the checkpoint's own values in the dtype (a GGUF file's blocks dequantized); `small` their int4 or
    int8 form, the same values where the file's blocks are 4-bit with fp16 scales (Q4_0, Q4_1).
    """

    def __init__(self, small: torch.nn.Module, dense: torch.nn.Module, dense_from_rows: int) -> None:
        super().__init__()
        self.small, self.dense, self.dense_from_rows = small, dense, dense_from_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return self.dense(x) if rows >= self.dense_from_rows else self.small(x)


def drop_dense_copies(model: torch.nn.Module) -> int:
    """Every TieredLinear in `model` replaced by its small (quantized) part, for a model whose long steps never
    reach torch (the native step serves them); returns how many dense copies were let go."""
    dropped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, TieredLinear):
                setattr(parent, name, child.small)
                dropped += 1
    return dropped
