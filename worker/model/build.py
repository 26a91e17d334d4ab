"""Assemble a model from HF-named tensor sources in the chosen dtype and weight mode; each family knows its layout.

The families (worker/model/families/) take a WeightBuilder (worker/model/weight_builder.py), which imports
none of them: the dependency runs one way.
"""

from __future__ import annotations

import torch

from worker.model.config import ModelConfig
from worker.model.families import family_by_key
from worker.model.weight_builder import WeightBuilder
from worker.model.weights import WeightMap


def build_model(
    config: ModelConfig,
    weights: WeightMap,
    dtype: torch.dtype,
    quant: str,
    device: torch.device,
    name: str = "",
    dense_from_rows: int | None = None,
    head_int8_below: int | None = None,
    lazy: bool = False,
) -> torch.nn.Module:
    """quant: none, int8 or int4 (int4 falls back to int8 for shapes its kernel cannot take); the rest: see WeightBuilder."""
    builder = WeightBuilder(weights, dtype, quant, device, name, dense_from_rows, head_int8_below, lazy)
    return family_by_key(config.architecture).build(config, builder).to(device).eval()
