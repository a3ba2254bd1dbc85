"""Top-k selection with a recency window: the one selection rule of calibration, the policies and the engine.

Everything here stays on the device (no ``.item()``, fixed output widths), so the engine's graph-captured
step runs the very code that the reference path and calibration run.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

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


def _ranked(scores: torch.Tensor, recent: int, last: torch.Tensor | int | None, valid: torch.Tensor | None,
            positions: torch.Tensor | None = None) -> torch.Tensor:
    """Scores with the candidates' rank keys: +inf for the recent window, -inf for what may not be chosen."""
    n = scores.shape[-1]
    ids = torch.arange(n, device=scores.device) if positions is None else positions
    if last is None:
        last = n - 1 if positions is None else positions.amax(-1)
    last = torch.as_tensor(last, device=scores.device)[..., None]  # [..., 1] or [1]
    ok = ids <= last
    if valid is not None:
        ok = ok & valid
    ranked = scores.float().masked_fill(~ok, float("-inf"))
    if recent > 0:
        ranked = torch.where(ok & (ids > last - recent), float("inf"), ranked)
    return ranked


def top_stable(ranked: torch.Tensor, k: int) -> Any:
    """The ``k`` best of ``ranked [..., n]`` (``.values`` and ``.indices``, best first), equal values toward the lower
    ids (as the Triton kernel breaks them): a stable sort, so the choice among ties does not depend on ``n`` (a row of
    a cache of any size chooses as the request alone, where ``torch.topk``'s choice among ties may differ)."""
    order = ranked.sort(dim=-1, descending=True, stable=True)
    return SimpleNamespace(values=order.values[..., :k], indices=order.indices[..., :k])


def topk_with_recent(scores: torch.Tensor, k: int, recent: int, valid: torch.Tensor | None = None,
                     last: torch.Tensor | int | None = None, ascending: bool = True,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`rolecall.runtime.kernels.topk_select.topk_with_recent`."""
    top = top_stable(_ranked(scores, recent, last, valid, positions), k)
    ids = top.indices if positions is None else positions.gather(-1, top.indices)
    if not ascending:  # the kernels read a set in any order: skip the sort
        return torch.where(top.values > float("-inf"), ids, -1)
    none = torch.iinfo(ids.dtype).max
    ids = torch.where(top.values > float("-inf"), ids, none).sort(dim=-1).values  # ascending, unchosen at the end
    return torch.where(ids < none, ids, -1)


def topk_mask_with_recent(scores: torch.Tensor, k: int, recent: int, valid: torch.Tensor | None = None,
                          last: torch.Tensor | int | None = None) -> torch.Tensor:
    """The same choice as :func:`topk_with_recent`, as a boolean ``[..., n]``."""
    top = top_stable(_ranked(scores, recent, last, valid), k)
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return chosen.scatter_(-1, top.indices, top.values > float("-inf"))
