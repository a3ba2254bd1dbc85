"""Reference sparse decode attention: one query token per sequence reads a chosen set of keys.

This is the truth the GPU kernels are tested against. It gathers the chosen keys, so it costs
O(B · Hkv · N · block_size · D) memory; a kernel reads the same blocks in place.
"""

from __future__ import annotations

import torch

from rolecall.runtime.kernels.paged_attention.tables import check_table, gather_pages


def expand_blocks(indices: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Block ids ``[..., N]`` → token ids ``[..., N * block_size]``; -1 where the block is padding or the token
    lies past ``length`` (the last block of a sequence may be partial)."""
    if block_size == 1:
        return torch.where(indices < length, indices, -1)
    offsets = torch.arange(block_size, device=indices.device)
    tokens = (indices[..., None] * block_size + offsets).flatten(-2)  # [..., N * bs]
    pad = (indices[..., None] < 0).expand(*indices.shape, block_size).flatten(-2)
    return torch.where(pad | (tokens >= length), -1, tokens)


def indices_to_mask(indices: torch.Tensor | None, block_size: int, length: int,
                    shape: tuple[int, int] | None = None) -> torch.Tensor:
    """Which tokens a set reads, as a boolean ``[B, Hkv, T]``. ``indices=None`` means every token (then
    ``shape = (B, Hkv)`` is required)."""
    if indices is None:
        if shape is None:
            raise ValueError("indices_to_mask needs shape=(B, Hkv) when indices is None")
        return torch.ones(*shape, length, dtype=torch.bool)
    tokens = expand_blocks(indices, block_size, length)
    mask = torch.zeros(*tokens.shape[:-1], length + 1, dtype=torch.bool, device=tokens.device)
    mask.scatter_(-1, torch.where(tokens < 0, length, tokens), True)  # padding lands in the spare last slot
    return mask[..., :length]


def sparse_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            indices: torch.Tensor | None = None, *, scale: float, block_size: int = 1,
                            log_weights: torch.Tensor | None = None,
                            key_mask: torch.Tensor | None = None,
                            block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`rolecall.runtime.kernels.sparse_attention.sparse_decode_attention` for the contract; a paged
    cache (``block_table``) is read in logical order first (:func:`gather_pages`)."""
    if block_table is not None:
        check_table(block_table, query.shape[0])
        key, value = gather_pages(key, block_table), gather_pages(value, block_table)
    b, hq, d = query.shape
    _, hkv, t, _ = key.shape
    g = hq // hkv
    q = query.float().view(b, hkv, g, d)
    if indices is None:
        tokens = torch.arange(t, device=key.device).expand(b, hkv, t)
        weights = None
    else:
        tokens = expand_blocks(indices, block_size, t)  # [B, Hkv, M]
        weights = None
        if log_weights is not None:
            weights = log_weights.float().repeat_interleave(block_size, dim=-1)  # [B, Hkv, M]
    valid = tokens >= 0
    safe = tokens.clamp(min=0)
    if key_mask is not None:
        km = key_mask.expand(b, t)[:, None, :].expand(b, hkv, t)
        valid = valid & km.gather(-1, safe)
    k = key.float().gather(2, safe[..., None].expand(*safe.shape, d))  # [B, Hkv, M, D]
    v = value.float().gather(2, safe[..., None].expand(*safe.shape, d))
    scores = torch.einsum("bhgd,bhmd->bhgm", q, k) * scale  # [B, Hkv, G, M]
    if weights is not None:
        scores = scores + weights[:, :, None, :]
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G]
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.einsum("bhgm,bhmd->bhgd", probs, v)  # empty sets give 0 (all probs are 0)
    return out.reshape(b, hq, d), lse.reshape(b, hq)
