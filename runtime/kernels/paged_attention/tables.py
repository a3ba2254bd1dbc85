"""Block tables: reading a paged cache's tokens in logical order, writing new tokens into their pages, and the check
every kernel that takes a table makes. Plain PyTorch, importing nothing of the kernels (each kernel's reference
and its Triton version import it)."""

from __future__ import annotations

import torch


def gather_pages(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``pool [N, Hkv, P, D]`` read through ``table [B, W]`` → ``[B, Hkv, W * P, D]`` in logical token order."""
    n, hkv, p, d = pool.shape
    b, w = table.shape
    picked = pool.index_select(0, table.reshape(-1).long()).view(b, w, hkv, p, d)
    return picked.permute(0, 2, 1, 3, 4).reshape(b, hkv, w * p, d)


def check_table(table: torch.Tensor | None, rows: int) -> None:
    """Refuse (``ValueError``) a block table that is not int32 ``[rows, W]``; None (a contiguous cache) passes."""
    if table is not None and (table.dim() != 2 or table.shape[0] != rows or table.dtype != torch.int32):
        raise ValueError(f"block_table must be int32 [B, W] with B = {rows}, got {table.dtype} {list(table.shape)}")


def write_tokens(key_pages: torch.Tensor, value_pages: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> None:
    """Write each sequence's new token (``key``, ``value [B, Hkv, D]``) at its logical slot ``positions [B]``: page
    ``table[b, pos // P]``, offset ``pos % P``."""
    p = key_pages.shape[2]
    pos = positions.long()
    page = table.long().gather(1, (pos // p)[:, None])[:, 0]  # [B]
    key_pages[page, :, pos % p] = key.to(key_pages.dtype)
    value_pages[page, :, pos % p] = value.to(value_pages.dtype)


def gather_tokens(key: torch.Tensor, ids: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
    """The K (or V) of each KV head's tokens ``ids [B, Hkv, n]`` (slots, in range): ``[B, Hkv, n, D]``, from a
    contiguous ``[B, Hkv, T, D]`` or a pool ``[N, Hkv, P, D]`` read through ``table [B, W]``."""
    if table is None:
        return key.gather(2, ids[..., None].expand(*ids.shape, key.shape[-1]))
    b, hkv, n = ids.shape
    p = key.shape[2]
    held = table.long().gather(1, torch.div(ids, p, rounding_mode="floor").reshape(b, -1)).view(b, hkv, n)
    heads = torch.arange(hkv, device=ids.device)[None, :, None]
    return key[held, heads, ids % p]

