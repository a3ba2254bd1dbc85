"""Reference skinny matmul: ``y = x Wᵀ + b`` for a few rows of ``x`` (what a decode step's projections are)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)
