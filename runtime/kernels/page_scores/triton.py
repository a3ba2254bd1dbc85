"""Triton page scores for selection layers, from the log-sum-exp the attention pass already produced.

``page_scores(query, key, lse, scale, page_size, key_mask=None, per_kv_head=False) -> scores``

===============  ===========================  ========================================================
``query``        ``[B, Hq, D]``               the decode query
``key``          ``[B, Hkv, T, D]``           the cache, read in place
``lse``          ``[B, Hq]`` float32          log-sum-exp of each head's logits over the attended keys
                                              (the second output of ``sparse_decode_attention``)
``key_mask``     ``[B or 1, T]`` bool         False = not attended (probability 0)
``scores``       ``[B, ceil(T / P)]``         Σ over the page of max over all query heads of p_h[t]
                 or ``[B, Hkv, ceil(T / P)]``  with ``per_kv_head``: max over each KV head's query group
===============  ===========================  ========================================================

``p_h[t] = exp(scale · q_h · k_t − lse_h)``: given the log-sum-exp, probabilities need only K, so a selection
layer reads its K once more and never writes probabilities to memory; the extra traffic is half of the
layer's K/V bytes, paid on the few Δ-layers (or retrieval heads) only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from rolecall.runtime.kernels import pdl, sm_count


@triton.jit
def _head_max(q_base, k_base, lse_base, tok, valid, s_qh, s_kt, s_lh, scale,
              G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """max over the query heads of one KV head's group of p_h[t], for a tile of tokens: ``[TILE]``."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    q = tl.load(q_base + g[:, None] * s_qh + d[None, :], mask=(g < G)[:, None] & (d < D)[None, :], other=0.0)
    k = tl.load(k_base + tok[:, None] * s_kt + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0)
    lse = tl.load(lse_base + g * s_lh, mask=g < G, other=float("inf"))  # padded heads get p = 0
    s = tl.dot(q, tl.trans(k)) * scale - lse[:, None]  # [G_PAD, TILE]
    p = tl.where(valid[None, :], tl.exp(s), 0.0)
    return tl.max(p, 0)


@triton.jit
def _page_scores(
    Q, K, LSE, KMASK, OUT,
    s_qb, s_qh, s_kb, s_kh, s_kt, s_lb, s_lh, s_mb, s_ob, s_oh,
    T, scale,
    HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    P: tl.constexpr, PAGES: tl.constexpr, PER_KV: tl.constexpr, HAS_KMASK: tl.constexpr,
):
    b = tl.program_id(0)
    kv = tl.program_id(1)  # the KV head with PER_KV, else 0
    tile = tl.program_id(2)
    tok = tile * PAGES * P + tl.arange(0, PAGES * P)
    valid = tok < T
    if HAS_KMASK:
        valid = valid & (tl.load(KMASK + b * s_mb + tok, mask=valid, other=0) != 0)
    if PER_KV:
        best = _head_max(Q + b * s_qb + kv * G * s_qh, K + b * s_kb + kv * s_kh, LSE + b * s_lb + kv * G * s_lh,
                         tok, valid, s_qh, s_kt, s_lh, scale, G, G_PAD, D, D_PAD)
    else:
        best = tl.zeros([PAGES * P], tl.float32)
        for h in tl.static_range(0, HKV):
            best = tl.maximum(best, _head_max(Q + b * s_qb + h * G * s_qh, K + b * s_kb + h * s_kh,
                                              LSE + b * s_lb + h * G * s_lh, tok, valid, s_qh, s_kt, s_lh,
                                              scale, G, G_PAD, D, D_PAD))
    pages = tl.sum(tl.reshape(best, (PAGES, P)), 1)  # [PAGES]
    page_ids = tile * PAGES + tl.arange(0, PAGES)
    tl.store(OUT + b * s_ob + kv * s_oh + page_ids, pages, mask=page_ids * P < T)


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, 1 << (x - 1).bit_length())


def page_scores(query: torch.Tensor, key: torch.Tensor, lse: torch.Tensor, scale: float, page_size: int,
                key_mask: torch.Tensor | None = None, per_kv_head: bool = False) -> torch.Tensor:
    """See the module docstring."""
    b, hq, d = query.shape
    _, hkv, t, _ = key.shape
    g = hq // hkv
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two for the GPU kernel, got {page_size}")
    query = query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    lse = lse.float().contiguous()
    n_pages = triton.cdiv(t, page_size)
    pages_per_prog = max(1, 128 // page_size)
    out = torch.empty(b, hkv if per_kv_head else 1, n_pages, device=query.device, dtype=torch.float32)
    km = key_mask.to(torch.int8).contiguous() if key_mask is not None else None
    grid = (b, hkv if per_kv_head else 1, triton.cdiv(n_pages, pages_per_prog))
    _page_scores[grid](
        query, key, lse, km if km is not None else query, out,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2), lse.stride(0), lse.stride(1),
        (km.stride(0) if km.shape[0] > 1 else 0) if km is not None else 0, out.stride(0), out.stride(1),
        t, float(scale),
        HKV=hkv, G=g, G_PAD=_pow2(g), D=d, D_PAD=_pow2(d), P=page_size, PAGES=pages_per_prog, PER_KV=per_kv_head,
        HAS_KMASK=km is not None,
    )
    return out if per_kv_head else out[:, 0]


@triton.jit
def _pages_from_logits(LG, LSE, OUT, LAST, s_gb, s_gh, s_lb, s_lh, s_ob, s_oh, s_last, T,
                       HEADS: tl.constexpr, P: tl.constexpr, PAGES: tl.constexpr, PER_KV: tl.constexpr,
                       HAS_LAST: tl.constexpr, PDL: tl.constexpr = False):
    pdl.wait(PDL)
    b = tl.program_id(0)
    kv = tl.program_id(1)  # with PER_KV: the KV head whose HEADS query heads are reduced
    tile = tl.program_id(2)
    tok = tile * PAGES * P + tl.arange(0, PAGES * P)
    valid = tok < T
    if HAS_LAST:  # slots past the row's last readable one are not read: their pages score 0
        valid = valid & (tok <= tl.load(LAST + b * s_last))
    first = kv * HEADS if PER_KV else 0
    best = tl.zeros([PAGES * P], tl.float32)
    for i in tl.static_range(0, HEADS):
        h = first + i
        lse = tl.load(LSE + b * s_lb + h * s_lh)
        logit = tl.load(LG + b * s_gb + h * s_gh + tok, mask=valid, other=float("-inf")).to(tl.float32)
        best = tl.maximum(best, tl.exp(logit - lse))
    pages = tl.sum(tl.reshape(best, (PAGES, P)), 1)
    page_ids = tile * PAGES + tl.arange(0, PAGES)
    tl.store(OUT + b * s_ob + kv * s_oh + page_ids, pages, mask=page_ids * P < T)


def page_scores_from_logits(logits: torch.Tensor, lse: torch.Tensor, page_size: int, num_kv_heads: int,
                            per_kv_head: bool = False, last: torch.Tensor | None = None) -> torch.Tensor:
    """Page scores from kept logits ``[B, Hq, T]`` (float32 or float16) and their log-sum-exp ``[B, Hq]``: same
    output as :func:`page_scores`, reading 2 or 4 bytes per head and token instead of the keys. ``last`` (a device
    scalar, or ``[B]`` where rows keep their own lengths): the last slot that holds a key; the logits past it are
    not read and their pages score 0, so the cost follows the context, not the cache's size."""
    b, hq, t = logits.shape
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two for the GPU kernel, got {page_size}")
    n_pages = triton.cdiv(t, page_size)
    pages_per_prog = max(1, 256 // page_size)
    groups = num_kv_heads if per_kv_head else 1
    out = torch.empty(b, groups, n_pages, device=logits.device, dtype=torch.float32)
    lse = lse.float()
    has_last = last is not None
    last = last if has_last else lse  # any pointer when there is no bound
    _pages_from_logits[(b, groups, triton.cdiv(n_pages, pages_per_prog))](
        logits, lse, out, last, logits.stride(0), logits.stride(1), lse.stride(0), lse.stride(1), out.stride(0),
        out.stride(1), last.stride(0) if has_last and last.dim() else 0, t, HEADS=hq // groups, P=page_size,
        PAGES=pages_per_prog, PER_KV=per_kv_head, HAS_LAST=has_last, **pdl.options(logits.device),
    )
    return out if per_kv_head else out[:, 0]


def mixed_keeping_logits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, indices: torch.Tensor,
                         scale: float, block_size: int, full_heads: int, key_mask: torch.Tensor | None = None,
                         keeping_heads: int | None = None,
                         **kernel: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One launch for a layer whose first ``full_heads`` KV heads read every token (LycheeDecode's retrieval
    heads, stored first) and whose others read ``indices`` ``[B, Hkv, N]`` (blocks of ``block_size``):
    ``(out [B, Hq, D], lse [B, Hq], logits)``, the logits ``[B, keeping_heads · G, T]`` (:func:`logits_dtype`) of
    the first ``keeping_heads`` KV heads' query heads only (default ``full_heads``; 0: no logits, None), which
    only they keep; :func:`page_scores_from_logits` turns them into their block scores per KV head."""
    from rolecall.runtime.kernels.sparse_attention import triton as attention

    b, hq, _ = query.shape
    hkv, t = key.shape[1], attention.tokens_of(key, kernel.get("block_table"))
    g = hq // hkv
    full = (torch.arange(hkv, device=query.device) < full_heads).expand(b, hkv)
    keeping = full_heads if keeping_heads is None else keeping_heads
    if not 0 <= keeping <= full_heads:
        raise ValueError(f"keeping_heads must be 0 to full_heads = {full_heads}, got {keeping}")
    logits = torch.empty(b, keeping * g, t, device=query.device, dtype=logits_dtype(query.dtype)) if keeping else None
    if "chunk" not in kernel:  # size chunks by the mean row (the kernel's default sizes them by the sparse rows,
        # which splits the full rows into so many chunks that their partial results outweigh the saved launch)
        mean = (full_heads * t + (hkv - full_heads) * indices.shape[-1] * block_size) / hkv
        kernel["chunk"] = attention.choose_chunk(math.ceil(mean), b * hkv, sm_count(query), dense=False)
    out, lse = attention.sparse_decode_attention(query, key, value, indices, scale=scale, block_size=block_size,
                                                 key_mask=key_mask, full_rows=full, logits_out=logits,
                                                 logit_heads=keeping or None, **kernel)
    return out, lse, logits


def decode_and_score(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, page_size: int,
                     key_mask: torch.Tensor | None = None, per_kv_head: bool = False,
                     **kernel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full decode attention of a selection layer and its page scores: ``(out [B, Hq, D], lse [B, Hq], scores)``.

    One pass over K/V computes the output and keeps the logits; a second, light pass over the logits turns
    them into page scores (``[B, pages]``, or ``[B, Hkv, pages]`` with ``per_kv_head``). No probabilities are
    written to memory and K is read once; the logits are kept as :func:`logits_dtype` says.
    """
    out, lse, logits = decode_keeping_logits(query, key, value, scale, key_mask=key_mask, **kernel)
    scores = page_scores_from_logits(logits, lse, page_size, key.shape[1], per_kv_head)
    return out, lse, scores


def logits_dtype(dtype: torch.dtype) -> torch.dtype:
    """How kept logits are stored for a model of ``dtype``: float16 beside bfloat16 or float16 weights, else
    float32. float16 keeps 11 significant bits, more than the 8 of the bfloat16 queries and keys the logits come
    from, and its range (±65,504) is far beyond any scaled logit; it halves the bytes the attention pass writes
    and the scoring pass reads. DS-Qwen-7B shape, 128K × 8, H200, same machine, two alternating runs each:
    lychee (32 retrieval KV heads) 8.91 → 8.83 ms a step, delta 6.88 → 6.84."""
    return torch.float16 if dtype in (torch.bfloat16, torch.float16) else torch.float32


def decode_keeping_logits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                          key_mask: torch.Tensor | None = None, keeping_heads: int | None = None,
                          **kernel: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full decode attention that keeps its logits: ``(out [B, Hq, D], lse [B, Hq], logits [B, keeping_heads · G,
    T])`` (stored as :func:`logits_dtype` says; the first ``keeping_heads`` KV heads' query heads, default all),
    what :func:`page_scores_from_logits` reads (:func:`decode_and_score` does both in turn)."""
    from rolecall.runtime.kernels.sparse_attention import triton as attention

    b, hq, _ = query.shape
    hkv = key.shape[1]
    keeping = hkv if keeping_heads is None else keeping_heads
    t = attention.tokens_of(key, kernel.get("block_table"))
    logits = torch.empty(b, keeping * (hq // hkv), t, device=query.device, dtype=logits_dtype(query.dtype))
    out, lse = attention.sparse_decode_attention(query, key, value, scale=scale, key_mask=key_mask,
                                                 logits_out=logits, logit_heads=keeping, **kernel)
    return out, lse, logits
