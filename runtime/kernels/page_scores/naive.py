"""Reference page scores of a Δ-layer: ``S[u] = Σ_{t in page u} max_h p_h[t]``."""

from __future__ import annotations

import math

import torch


def attention_probs(query: torch.Tensor, key: torch.Tensor, scale: float,
                    key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of one decode query per sequence: ``[B, Hq, D]`` × ``[B, Hkv, T, D]`` → ``[B, Hq, T]``
    in float32 (masked keys get probability 0)."""
    b, hq, d = query.shape
    hkv, t = key.shape[1], key.shape[2]
    q = query.float().view(b, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,bhtd->bhgt", q, key.float()).reshape(b, hq, t) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask.expand(b, t)[:, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


def head_max_probs(query: torch.Tensor, key: torch.Tensor, scale: float,
                   key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``max_h p_h[t]`` over all query heads: ``[B, T]``."""
    return attention_probs(query, key, scale, key_mask).amax(dim=1)


def pool_pages(token_scores: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[..., T]`` → ``[..., ceil(T / P)]`` sums over consecutive pages (the last one may be partial)."""
    t = token_scores.shape[-1]
    pages = math.ceil(t / page_size)
    padded = torch.nn.functional.pad(token_scores.float(), (0, pages * page_size - t))
    return padded.view(*token_scores.shape[:-1], pages, page_size).sum(-1)


def page_scores(query: torch.Tensor, key: torch.Tensor, scale: float, page_size: int,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`runtime.kernels.page_scores.page_scores`."""
    return pool_pages(head_max_probs(query, key, scale, key_mask), page_size)
