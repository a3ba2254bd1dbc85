"""Reference top-k selection with a recency window."""

from __future__ import annotations

import torch


def mask_to_indices(mask: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """``[..., n]`` bool → ascending ids of the True entries ``[..., width]``, -1 padded at the end.

    ``width`` defaults to the largest count in the batch."""
    n = mask.shape[-1]
    count = int(mask.sum(-1).max()) if mask.numel() else 0
    width = count if width is None else width
    ids = torch.arange(n, device=mask.device).expand_as(mask)
    # Sort key: selected ids keep their value, unselected go past the end.
    key = torch.where(mask, ids, n + ids)
    order = key.sort(dim=-1).values[..., :width]
    return torch.where(order < n, order, -1)


def topk_with_recent(scores: torch.Tensor, k: int, recent: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`runtime.kernels.topk_select.topk_with_recent`."""
    n = scores.shape[-1]
    width = min(k, n)
    s = scores.float().clone()
    if recent > 0:
        s[..., max(n - recent, 0):] = float("inf")
    if valid is not None:
        s = s.masked_fill(~valid, float("-inf"))
    top = s.topk(width, dim=-1)
    chosen = torch.zeros(s.shape, dtype=torch.bool, device=s.device)
    chosen.scatter_(-1, top.indices, top.values > float("-inf"))
    return mask_to_indices(chosen, width)
