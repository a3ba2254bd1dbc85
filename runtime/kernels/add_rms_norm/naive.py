"""Reference of :mod:`rolecall.runtime.kernels.add_rms_norm`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float,
                 o_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + o`` (``o`` RMS-normed by ``o_weight`` first when given) and that sum RMS-normed by ``weight``."""
    if o_weight is not None:
        o = rms_norm(o, o_weight, eps)
    x = x + o
    return x, rms_norm(x, weight, eps)
