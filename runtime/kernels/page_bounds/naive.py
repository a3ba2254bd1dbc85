"""PyTorch references of :mod:`rolecall.runtime.kernels.page_bounds`."""

from __future__ import annotations

import math
from typing import Any

import torch

from rolecall.runtime.kernels.paged_attention.tables import check_table, gather_tokens


def page_minmax(key: torch.Tensor, keep: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[B, Hkv, T, D]`` and readable slots ``[B, T]`` → elementwise ``(kmin, kmax)`` per page, each
    ``[B, Hkv, ceil(T / P), D]`` in the keys' dtype (exact: a min or max is one of the values); a page with no
    readable slot has ``kmin = +inf, kmax = -inf``."""
    b, hkv, t, d = key.shape
    n = math.ceil(t / page_size)
    k = torch.nn.functional.pad(key, (0, 0, 0, n * page_size - t))  # [B, Hkv, n·P, D]
    ok = torch.nn.functional.pad(keep, (0, n * page_size - t), value=False)[:, None, :, None]  # [B, 1, n·P, 1]
    kmin = k.masked_fill(~ok, math.inf).view(b, hkv, n, page_size, d).amin(3)
    kmax = k.masked_fill(~ok, -math.inf).view(b, hkv, n, page_size, d).amax(3)
    return kmin, kmax


def page_bounds(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float) -> torch.Tensor:
    """Query ``[B, Hq, D]`` and page metadata ``[B, Hkv, n, D]`` → upper bounds ``[B, Hq, n]`` of the logit
    ``scale · q · k`` of any token in the page; ``-inf`` for empty pages.

    ``max(q_d · kmin_d, q_d · kmax_d) = q⁺_d · kmax_d + q⁻_d · kmin_d`` with ``q⁺ = max(q, 0)``, ``q⁻ = min(q, 0)``,
    so the bound is two matrix products."""
    b, hq, d = query.shape
    hkv = kmin.shape[1]
    empty = kmax[..., 0] < kmin[..., 0]  # [B, Hkv, n]
    lo, hi = kmin.float().masked_fill(empty[..., None], 0.0), kmax.float().masked_fill(empty[..., None], 0.0)
    q = query.float().view(b, hkv, hq // hkv, d)
    bound = (torch.einsum("bhgd,bhnd->bhgn", q.clamp_min(0), hi) + torch.einsum("bhgd,bhnd->bhgn", q.clamp_max(0), lo))
    bound = bound.masked_fill(empty[:, :, None, :], -math.inf) * scale
    return bound.reshape(b, hq, -1)


def page_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float,
                group: str = "max", pages: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, Hkv, n]``: each KV head's page bounds over its query group, their maximum or their sum. With
    ``pages [B, Hkv, C]`` (page ids, -1 = none) only those pages: ``[B, Hkv, C]``, ``-inf`` for -1."""
    if pages is not None:
        at = pages.long().clamp_min(0)[..., None].expand(-1, -1, -1, kmin.shape[-1])
        scores = page_scores(query, kmin.gather(2, at), kmax.gather(2, at), scale, group)
        return scores.masked_fill(pages < 0, -math.inf)
    b, hkv = kmin.shape[:2]
    bounds = page_bounds(query, kmin, kmax, scale).view(b, hkv, query.shape[1] // hkv, -1)
    return bounds.amax(2) if group == "max" else bounds.sum(2)


NEW_PAGE = ("key", "first", "last", "page_size", "block_table")  # what new_page holds, in order


def update_page(key: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
                page_size: int, block_table: torch.Tensor | None = None) -> None:
    """Recompute, in place, the minimum and maximum of the page that holds slot ``last`` (a device scalar, or
    ``[B]``: each row's own) from the keys ``[B, Hkv, T, D]`` in slots ``first[b]..last`` (a pool of pages read
    through ``block_table [B, W]``: its rows' slots in logical order, ``T = W · 16``)."""
    bsz, hkv, d = kmin.shape[0], key.shape[1], key.shape[3]
    t = key.shape[2] * (block_table.shape[1] if block_table is not None else 1)
    last = last.expand(bsz)[:, None]  # [B, 1]
    page = torch.div(last, page_size, rounding_mode="floor")  # [B, 1]
    raw = page * page_size + torch.arange(page_size, device=key.device)  # [B, P]
    slots = raw.clamp_max(t - 1)  # the cache may end inside its last page
    ok = ((raw >= first[:, None]) & (raw <= last) & (raw < t))[:, None, :, None]  # [B, 1, P, 1]
    if block_table is not None:
        check_table(block_table, bsz)
    keys = gather_tokens(key, slots[:, None, :].expand(bsz, hkv, page_size), block_table)  # [B, Hkv, P, D]
    at = page[:, None, :, None].expand(bsz, hkv, 1, d)
    kmin.scatter_(2, at, keys.masked_fill(~ok, math.inf).amin(2, keepdim=True).to(kmin.dtype))
    kmax.scatter_(2, at, keys.masked_fill(~ok, -math.inf).amax(2, keepdim=True).to(kmax.dtype))


def refine_candidates(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, candidates: torch.Tensor,
                      scale: float, num_pages: int, recent_pages: int, group: str = "max",
                      new_page: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, Any] | None = None) -> torch.Tensor:
    """Two-stage selection's second stage: candidate page ids ``[B, Hkv, C]`` (any order, -1 = none; a Δ-layer's
    choice, whose largest page is the new token's) → per KV head at most ``num_pages`` of them: the candidates
    within ``recent_pages`` of the largest always (the recent pages), then those of highest :func:`page_scores`;
    ``[B, Hkv, min(num_pages, C)]`` ascending page ids, -1 padded. Reads the metadata of the candidates only;
    no host sync. ``new_page = (key, first, last, page_size, block_table)`` (:data:`NEW_PAGE`): first
    :func:`update_page` the metadata in place."""
    from rolecall.runtime.kernels.topk_select import topk_with_recent

    if new_page is not None:
        update_page(kmin=kmin, kmax=kmax, **dict(zip(NEW_PAGE, new_page)))

    scores = page_scores(query, kmin, kmax, scale, group, pages=candidates)  # [B, Hkv, C], -inf for -1
    ids = candidates.long()
    return topk_with_recent(scores, num_pages, recent_pages, ids >= 0, positions=ids).to(candidates.dtype)
