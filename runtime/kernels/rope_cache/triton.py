"""Triton kernel of :mod:`rolecall.runtime.kernels.rope_cache`: one program per (row, head of q, k or v)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rolecall.runtime.kernels import pdl
from rolecall.runtime.kernels.paged_attention.tables import check_table


@triton.jit
def _normed(y_row, d, ok, NORM, eps, D: tl.constexpr, HAS_NORM: tl.constexpr):
    """One head of ``y`` in float32, and the same head rolled by D/2, each RMS-normed (rounded to ``y``'s
    dtype, as the reference's norm returns it) when the layer has per-head norms."""
    half = (d + D // 2) % D
    x = tl.load(y_row + d, mask=ok, other=0.0)
    rolled = tl.load(y_row + half, mask=ok, other=0.0)
    dtype = x.dtype
    x, rolled = x.to(tl.float32), rolled.to(tl.float32)
    if HAS_NORM:
        r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        x = (x * r * tl.load(NORM + d, mask=ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        rolled = (rolled * r * tl.load(NORM + half, mask=ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    return x, rolled


@triton.jit
def _rope_store(Y, COS, SIN, QN, KN, Q, KC, VC, SLOT, ORDER, TABLE,
                s_yb, s_cb, s_sb, s_qb, s_qh, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_tb, eps,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                HAS_NORM: tl.constexpr, HAS_ORDER: tl.constexpr, PDL: tl.constexpr, PAGED: tl.constexpr,
                PAGE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)  # [0, HQ): query heads, [HQ, HQ + HKV): keys, then values
    src = h  # the head of y this program reads: with ORDER, stored KV head j is the model's head ORDER[j]
    if HAS_ORDER:  # read before the wait: no kernel of the step writes the map
        if h < HQ:
            src = tl.load(ORDER + h // (HQ // HKV)) * (HQ // HKV) + h % (HQ // HKV)
        elif h < HQ + HKV:
            src = HQ + tl.load(ORDER + h - HQ)
        else:
            src = HQ + HKV + tl.load(ORDER + h - HQ - HKV)
    pdl.wait(PDL)
    pdl.let_next_start(PDL)  # the attention's programs may be placed now; they wait for these to finish
    d = tl.arange(0, D_PAD)
    ok = d < D
    slot = tl.load(SLOT + b * s_sb)  # one slot for every row (s_sb = 0), or the row's own
    k_at = b * s_kb + slot * s_kt
    v_at = b * s_vb + slot * s_vt
    if PAGED:  # the slot's page in the row's block table (s_kb, s_vb: a page's stride)
        page = tl.load(TABLE + b * s_tb + slot // PAGE).to(tl.int64)
        k_at = page * s_kb + (slot % PAGE) * s_kt
        v_at = page * s_vb + (slot % PAGE) * s_vt
    y_row = Y + b * s_yb + src * D
    if h >= HQ + HKV:
        v = tl.load(y_row + d, mask=ok, other=0.0)
        tl.store(VC + v_at + (h - HQ - HKV) * s_vh + d, v.to(VC.dtype.element_ty), mask=ok)
    else:
        c = tl.load(COS + b * s_cb + d, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(SIN + b * s_cb + d, mask=ok, other=0.0).to(tl.float32)
        if h < HQ:
            x, rolled = _normed(y_row, d, ok, QN, eps, D, HAS_NORM)
            tl.store(Q + b * s_qb + h * s_qh + d, (x * c + rolled * s).to(Q.dtype.element_ty), mask=ok)
        else:
            x, rolled = _normed(y_row, d, ok, KN, eps, D, HAS_NORM)
            tl.store(KC + k_at + (h - HQ) * s_kh + d, (x * c + rolled * s).to(KC.dtype.element_ty), mask=ok)


def rope_and_store(y: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 1e-6, order: torch.Tensor | None = None,
                   block_table: torch.Tensor | None = None) -> torch.Tensor:
    """See :mod:`rolecall.runtime.kernels.rope_cache`."""
    b, width = y.shape
    d = k_cache.shape[-1]
    if width != (heads + 2 * kv_heads) * d or y.stride(-1) != 1 or (q_norm is None) != (k_norm is None):
        raise ValueError(f"y [B, {width}] does not hold {heads} + 2 × {kv_heads} heads of {d}, is not contiguous "
                         "in its last dimension, or only one of q_norm / k_norm was given")
    if any(t.stride(-1) != 1 for t in (cos, sin, k_cache, v_cache)) or cos.stride() != sin.stride():
        raise ValueError("cos, sin and the caches need a unit last stride, and cos and sin the same strides")
    if order is not None and (order.shape != (kv_heads,) or order.dtype != torch.int32):
        raise ValueError(f"order must be int32 [{kv_heads}], got {order.dtype} {list(order.shape)}")
    if slot.numel() not in (1, b):
        raise ValueError(f"slot must be one slot or one per row ({b}), got {list(slot.shape)}")
    check_table(block_table, b)
    q = torch.empty(b, heads, d, device=y.device, dtype=y.dtype)
    norm = q_norm is not None
    _rope_store[(b, heads + 2 * kv_heads)](
        y, cos, sin, q_norm if norm else y, k_norm if norm else y, q, k_cache, v_cache, slot,
        order if order is not None else slot, block_table if block_table is not None else slot,
        y.stride(0), cos.stride(0), slot.stride(0) if slot.numel() > 1 else 0, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0) if block_table is not None else 0, float(eps),
        HQ=heads, HKV=kv_heads, D=d, D_PAD=triton.next_power_of_2(d), HAS_NORM=norm,
        HAS_ORDER=order is not None, PAGED=block_table is not None, PAGE=k_cache.shape[2], num_warps=1,
        **pdl.options(y.device),
    )
    return q
