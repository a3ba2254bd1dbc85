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
    """See :func:`rolecall.runtime.kernels.page_scores.page_scores`."""
    return pool_pages(head_max_probs(query, key, scale, key_mask), page_size)


def decode_and_score(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, page_size: int,
                     key_mask: torch.Tensor | None = None, per_kv_head: bool = False,
                     block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of the Triton ``decode_and_score``: dense decode attention and the page scores of the same
    pass, ``(out [B, Hq, D], lse [B, Hq], scores [B, pages] or [B, Hkv, pages])``; a paged cache
    (``block_table``) is read in logical order first."""
    from rolecall.runtime.kernels.paged_attention.tables import check_table, gather_pages
    from rolecall.runtime.kernels.sparse_attention.naive import sparse_decode_attention

    if block_table is not None:
        check_table(block_table, query.shape[0])
        key, value = gather_pages(key, block_table), gather_pages(value, block_table)
    mask = key_mask.bool() if key_mask is not None else None
    out, lse = sparse_decode_attention(query, key, value, scale=scale, key_mask=mask)
    probs = attention_probs(query, key, scale, mask)  # [B, Hq, T]
    b, hq, t = probs.shape
    hkv = key.shape[1]
    best = probs.view(b, hkv, hq // hkv, t).amax(2) if per_kv_head else probs.amax(1)
    return out, lse, pool_pages(best, page_size)
