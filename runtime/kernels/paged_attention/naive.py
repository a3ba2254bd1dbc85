"""Reference paged decode attention: gather a sequence's pages into logical order, then the sparse reference."""

from __future__ import annotations

import torch

from rolecall.runtime.kernels.paged_attention.tables import check_table, gather_pages, write_tokens
from rolecall.runtime.kernels.sparse_attention import naive as sparse


def paged_decode_attention(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                           table: torch.Tensor, lengths: torch.Tensor, *, scale: float,
                           indices: torch.Tensor | None = None, block_size: int = 1,
                           log_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See :mod:`rolecall.runtime.kernels.paged_attention` for the contract."""
    tokens = table.shape[1] * key_pages.shape[2]
    held = torch.arange(tokens, device=key_pages.device)[None, :] < lengths.to(key_pages.device)[:, None]  # [B, W * P]
    return sparse.sparse_decode_attention(query, key_pages, value_pages, indices, scale=scale, block_size=block_size,
                                          log_weights=log_weights, key_mask=held, block_table=table)


__all__ = ["check_table", "gather_pages", "paged_decode_attention", "write_tokens"]
