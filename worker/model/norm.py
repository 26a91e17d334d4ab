"""RMSNorm, the one norm every family's decoder uses (Gemma's x * (1 + w) is built as weight 1 + w: families/base.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
