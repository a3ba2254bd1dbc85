"""PyTorch reference of :mod:`rolecall.runtime.kernels.rope_cache` (the arithmetic the engine's prefill also runs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rolecall.runtime.kernels.paged_attention.tables import check_table, write_tokens


def split_rope(y: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
               q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
               eps: float = 1e-6, order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``y [..., (Hq + 2 Hkv) · D]`` → ``q [..., Hq, D]``, ``k``, ``v [..., Hkv, D]`` with the per-head norms
    and RoPE applied to q and k. ``cos``/``sin`` broadcast against ``[..., 1, D]``. ``order [Hkv]``: KV head j
    of the result is the model's head ``order[j]``, its query heads with it."""
    d = y.shape[-1] // (heads + 2 * kv_heads)
    q = y[..., : heads * d].unflatten(-1, (heads, d))
    k = y[..., heads * d:(heads + kv_heads) * d].unflatten(-1, (kv_heads, d))
    v = y[..., (heads + kv_heads) * d:].unflatten(-1, (kv_heads, d))
    if order is not None:
        order = order.to(device=y.device, dtype=torch.long)
        q = q.unflatten(-2, (kv_heads, heads // kv_heads)).index_select(-3, order).flatten(-3, -2)
        k, v = k.index_select(-2, order), v.index_select(-2, order)
    if q_norm is not None:
        q, k = F.rms_norm(q, (d,), q_norm, eps), F.rms_norm(k, (d,), k_norm, eps)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    q = q * cos + q.roll(d // 2, -1) * sin
    k = k * cos + k.roll(d // 2, -1) * sin
    return q, k, v


def rope_and_store(y: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 1e-6, order: torch.Tensor | None = None,
                   block_table: torch.Tensor | None = None) -> torch.Tensor:
    """See :mod:`rolecall.runtime.kernels.rope_cache`."""
    q, k, v = split_rope(y, heads, kv_heads, cos, sin, q_norm, k_norm, eps, order)
    if block_table is not None:
        check_table(block_table, k.shape[0])
        write_tokens(k_cache, v_cache, block_table, slot.expand(k.shape[0]), k, v)
    elif slot.numel() == 1:
        at = slot.reshape(1)
        k_cache.index_copy_(2, at, k[:, :, None].to(k_cache.dtype))
        v_cache.index_copy_(2, at, v[:, :, None].to(v_cache.dtype))
    else:  # each row its own slot
        rows = torch.arange(k.shape[0], device=k.device)
        k_cache[rows, :, slot] = k.to(k_cache.dtype)
        v_cache[rows, :, slot] = v.to(v_cache.dtype)
    return q
