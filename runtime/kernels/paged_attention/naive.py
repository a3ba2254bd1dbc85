"""Reference paged decode attention: gather a sequence's pages into logical order, then the sparse reference."""

from __future__ import annotations

import torch

from rolecall.runtime.kernels.sparse_attention import naive as sparse


def gather_pages(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``pool [N, Hkv, P, D]`` read through ``table [B, W]`` → ``[B, Hkv, W * P, D]`` in logical token order."""
    n, hkv, p, d = pool.shape
    b, w = table.shape
    picked = pool.index_select(0, table.reshape(-1).long()).view(b, w, hkv, p, d)
    return picked.permute(0, 2, 1, 3, 4).reshape(b, hkv, w * p, d)


def write_tokens(key_pages: torch.Tensor, value_pages: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> None:
    """Write each sequence's new token (``key``, ``value [B, Hkv, D]``) at its logical slot ``positions [B]``: page
    ``table[b, pos // P]``, offset ``pos % P``."""
    p = key_pages.shape[2]
    pos = positions.long()
    page = table.long().gather(1, (pos // p)[:, None])[:, 0]  # [B]
    key_pages[page, :, pos % p] = key.to(key_pages.dtype)
    value_pages[page, :, pos % p] = value.to(value_pages.dtype)


def paged_decode_attention(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                           table: torch.Tensor, lengths: torch.Tensor, *, scale: float,
                           indices: torch.Tensor | None = None, block_size: int = 1,
                           log_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See :mod:`rolecall.runtime.kernels.paged_attention` for the contract."""
    key, value = gather_pages(key_pages, table), gather_pages(value_pages, table)
    held = torch.arange(key.shape[2], device=key.device)[None, :] < lengths.to(key.device)[:, None]  # [B, W * P]
    return sparse.sparse_decode_attention(query, key, value, indices, scale=scale, block_size=block_size,
                                          log_weights=log_weights, key_mask=held)
