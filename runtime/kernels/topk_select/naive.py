"""Top-k selection with a recency window: the one selection rule of calibration, the policies and the engine.

Everything here stays on the device (no ``.item()``, fixed output widths), so the engine's graph-captured
step runs the very code that the reference path and calibration run.
"""

from __future__ import annotations

import torch


def mask_to_indices(mask: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """``[..., n]`` bool → ascending ids of the True entries ``[..., width]``, -1 padded at the end.

    ``width`` defaults to the largest count in the batch (which reads that count on the host)."""
    n = mask.shape[-1]
    if width is None:
        width = int(mask.sum(-1).max()) if mask.numel() else 0
    ids = torch.arange(n, device=mask.device).expand_as(mask)
    # Sort key: selected ids keep their value, unselected go past the end.
    key = torch.where(mask, ids, n + ids)
    order = key.sort(dim=-1).values[..., :width]
    return torch.where(order < n, order, -1)


def _ranked(scores: torch.Tensor, recent: int, last: torch.Tensor | int | None,
            valid: torch.Tensor | None) -> torch.Tensor:
    """Scores with the candidates' rank keys: +inf for the recent window, -inf for what may not be chosen."""
    n = scores.shape[-1]
    ids = torch.arange(n, device=scores.device)
    if last is None:
        last = n - 1
    last = torch.as_tensor(last, device=scores.device)[..., None]  # [..., 1] or [1]
    ok = ids <= last
    if valid is not None:
        ok = ok & valid
    ranked = scores.float().masked_fill(~ok, float("-inf"))
    if recent > 0:
        ranked = torch.where(ok & (ids > last - recent), float("inf"), ranked)
    return ranked


def topk_with_recent(scores: torch.Tensor, k: int, recent: int, valid: torch.Tensor | None = None,
                     last: torch.Tensor | int | None = None, ascending: bool = True) -> torch.Tensor:
    """See :func:`runtime.kernels.topk_select.topk_with_recent`."""
    n = scores.shape[-1]
    top = _ranked(scores, recent, last, valid).topk(min(k, n), dim=-1, sorted=False)
    if not ascending:  # the kernels read a set in any order: skip the sort
        return torch.where(top.values > float("-inf"), top.indices, -1)
    ids = torch.where(top.values > float("-inf"), top.indices, n)
    ids = ids.sort(dim=-1).values  # ascending, unchosen (n) at the end
    return torch.where(ids < n, ids, -1)


def topk_mask_with_recent(scores: torch.Tensor, k: int, recent: int, valid: torch.Tensor | None = None,
                          last: torch.Tensor | int | None = None) -> torch.Tensor:
    """The same choice as :func:`topk_with_recent`, as a boolean ``[..., n]``."""
    n = scores.shape[-1]
    top = _ranked(scores, recent, last, valid).topk(min(k, n), dim=-1, sorted=False)
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return chosen.scatter_(-1, top.indices, top.values > float("-inf"))
