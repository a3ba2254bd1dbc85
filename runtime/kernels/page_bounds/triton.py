"""Triton kernels of :mod:`rolecall.runtime.kernels.page_bounds` for the engine's step."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from rolecall.runtime.kernels.arrivals import arrival_counters
from rolecall.runtime.kernels.page_bounds.naive import NEW_PAGE
from rolecall.runtime.kernels.paged_attention.tables import check_table
from rolecall.runtime.kernels.topk_select.triton import MAX_N, store_ascending, top_w


@triton.jit
def _group_bounds(Q, KMIN, KMAX, b, h, pages, ok, s_qb, s_qh, s_mb, s_mh, s_mn, scale, G: tl.constexpr,
                  G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, GROUP_MAX: tl.constexpr):
    """``[PB]`` scores of ``pages`` (where ``ok``) for KV head ``h`` of sequence ``b``: the query group's bounds,
    their max or sum; ``-inf`` for empty pages and where not ``ok``."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    base = b * s_mb + h * s_mh + pages[:, None] * s_mn + d[None, :]
    lo = tl.load(KMIN + base, mask=ok[:, None] & (d < D)[None, :], other=0.0)
    hi = tl.load(KMAX + base, mask=ok[:, None] & (d < D)[None, :], other=0.0)
    lo0 = tl.load(KMIN + b * s_mb + h * s_mh + pages * s_mn, mask=ok, other=1.0)
    hi0 = tl.load(KMAX + b * s_mb + h * s_mh + pages * s_mn, mask=ok, other=0.0)
    empty = hi0 < lo0  # also where not ok
    lo = tl.where(empty[:, None], 0.0, lo)
    hi = tl.where(empty[:, None], 0.0, hi)
    q = tl.load(Q + b * s_qb + (h * G + g)[:, None] * s_qh + d[None, :], mask=(g < G)[:, None] & (d < D)[None, :],
                other=0.0)
    pos = tl.maximum(q, 0.0).to(hi.dtype)
    neg = tl.minimum(q, 0.0).to(lo.dtype)
    bound = (tl.dot(pos, tl.trans(hi)) + tl.dot(neg, tl.trans(lo))) * scale  # [G_PAD, PB] float32
    if GROUP_MAX:
        score = tl.max(tl.where((g < G)[:, None], bound, float("-inf")), 0)
    else:
        score = tl.sum(tl.where((g < G)[:, None], bound, 0.0), 0)
    return tl.where(empty, float("-inf"), score)


@triton.jit
def _page_scores(Q, KMIN, KMAX, OUT, IDX, s_qb, s_qh, s_mb, s_mh, s_mn, s_ob, s_oh, s_ib, s_ih, n, scale, HKV,
                 G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PB: tl.constexpr,
                 GROUP_MAX: tl.constexpr, HAS_IDX: tl.constexpr):
    row = tl.program_id(0)  # (sequence, KV head)
    b = row // HKV
    h = row % HKV
    entry = tl.program_id(1) * PB + tl.arange(0, PB)  # the output column: a page, or a place in IDX's list
    if HAS_IDX:
        pages = tl.load(IDX + b * s_ib + h * s_ih + entry, mask=entry < n, other=-1)
        ok = pages >= 0
        written = entry < n  # a -1 entry gets -inf
    else:
        pages = entry
        ok = pages < n
        written = ok
    score = _group_bounds(Q, KMIN, KMAX, b, h, pages, ok, s_qb, s_qh, s_mb, s_mh, s_mn, scale, G, G_PAD, D, D_PAD,
                          GROUP_MAX)
    tl.store(OUT + b * s_ob + h * s_oh + entry, score, mask=written)


def page_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float,
                group: str = "max", pages: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`rolecall.runtime.kernels.page_bounds.naive.page_scores` (``pages``: read in the kernel, no gather)."""
    b, hq, d = query.shape
    _, hkv, n, dk = kmin.shape
    if dk != d or hq % hkv or kmin.stride() != kmax.stride() or kmin.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError(f"query [B, {hq}, {d}] does not fit page metadata [B, {hkv}, n, {dk}] with unit last "
                         "strides (kmin and kmax alike)")
    g = hq // hkv
    width = n if pages is None else pages.shape[-1]
    out = torch.empty(b, hkv, width, device=query.device, dtype=torch.float32)
    idx = (out, 0, 0) if pages is None else (pages, pages.stride(0), pages.stride(1))
    pb = 64
    _page_scores[(b * hkv, triton.cdiv(width, pb))](
        query, kmin, kmax, out, idx[0], query.stride(0), query.stride(1), kmin.stride(0), kmin.stride(1),
        kmin.stride(2), out.stride(0), out.stride(1), idx[1], idx[2], width, float(scale), hkv, G=g,
        G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=max(16, triton.next_power_of_2(d)), PB=pb,
        GROUP_MAX=group == "max", HAS_IDX=pages is not None,
    )
    return out


@triton.jit
def _store_page(K, KMIN, KMAX, FIRST, LAST, TABLE, b, h, s_kb, s_kh, s_kt, s_mb, s_mh, s_mn, s_lb, s_tb, T,
                P: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PAGED: tl.constexpr, KP: tl.constexpr):
    """Recompute the minimum and maximum of KV head ``h``'s page that holds slot ``LAST`` of sequence ``b`` (one
    slot for all, ``s_lb`` 0, or each row's own). ``PAGED``: ``K`` is a pool of ``KP``-token pages (``s_kb`` a page's
    stride) and slot s of row b sits at offset ``s % KP`` of page ``TABLE[b, s // KP]``."""
    last = tl.load(LAST + b * s_lb)
    page = last // P
    slots = page * P + tl.arange(0, P)
    d = tl.arange(0, D_PAD)
    ok = (slots >= tl.load(FIRST + b)) & (slots <= last) & (slots < T)
    if PAGED:
        held = tl.load(TABLE + b * s_tb + slots // KP, mask=ok, other=0).to(tl.int64)
        at = held * s_kb + (slots % KP) * s_kt
    else:
        at = b * s_kb + slots * s_kt
    keys = tl.load(K + h * s_kh + at[:, None] + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0)
    lo = tl.min(tl.where(ok[:, None], keys, float("inf")), 0)
    hi = tl.max(tl.where(ok[:, None], keys, float("-inf")), 0)
    dst = b * s_mb + h * s_mh + page * s_mn + d
    tl.store(KMIN + dst, lo.to(KMIN.dtype.element_ty), mask=d < D)
    tl.store(KMAX + dst, hi.to(KMAX.dtype.element_ty), mask=d < D)


@triton.jit
def _update_page(K, KMIN, KMAX, FIRST, LAST, TABLE, s_kb, s_kh, s_kt, s_mb, s_mh, s_mn, s_lb, s_tb, T, HKV,
                 P: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PAGED: tl.constexpr, KP: tl.constexpr):
    row = tl.program_id(0)
    _store_page(K, KMIN, KMAX, FIRST, LAST, TABLE, row // HKV, row % HKV, s_kb, s_kh, s_kt, s_mb, s_mh, s_mn, s_lb,
                s_tb, T, P, D, D_PAD, PAGED, KP)


def update_page(key: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
                page_size: int, block_table: torch.Tensor | None = None) -> None:
    """See :func:`rolecall.runtime.kernels.page_bounds.naive.update_page`."""
    b, hkv, d = kmin.shape[0], key.shape[1], key.shape[3]
    _check_page_update(key, kmin, kmax, page_size)
    check_table(block_table, b)
    _update_page[(b * hkv,)](key, kmin, kmax, first, last, *_paged(key, block_table), kmin.stride(0), kmin.stride(1),
                             kmin.stride(2), row_stride(last), *_table(key, block_table), hkv, P=page_size, D=d,
                             D_PAD=triton.next_power_of_2(d), PAGED=block_table is not None, KP=key.shape[2])


def _paged(key: torch.Tensor, table: torch.Tensor | None) -> tuple[Any, int, int, int]:
    """The table pointer (the keys where there is none) and the keys' strides (a pool's first is its page's)."""
    return (table if table is not None else key), key.stride(0), key.stride(1), key.stride(2)


def _table(key: torch.Tensor, table: torch.Tensor | None) -> tuple[int, int]:
    """The table's row stride and the slots a row holds (``T``)."""
    return (table.stride(0), table.shape[1] * key.shape[2]) if table is not None else (0, key.shape[2])


def row_stride(last: torch.Tensor) -> int:
    """The stride between rows' last slots: 0 for one slot of all rows (a device scalar), else its own."""
    return last.stride(0) if last.dim() else 0


def _check_page_update(key: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page_size: int) -> None:
    """What the kernels that recompute a page's metadata (:func:`_store_page`) need of their arguments."""
    if page_size & (page_size - 1) or kmin.stride() != kmax.stride() or key.stride(-1) != 1:
        raise ValueError(f"page_size {page_size} must be a power of two, kmin and kmax alike, keys contiguous in D")


@triton.jit
def _refine(Q, KMIN, KMAX, CAND, SCORES, ARRIVED, OUT, K, FIRST, LAST, TABLE, s_qb, s_qh, s_mb, s_mh, s_mn, s_cb,
            s_ch, s_kb, s_kh, s_kt, s_lb, s_tb, T, C, scale, HKV, G: tl.constexpr, G_PAD: tl.constexpr,
            D: tl.constexpr, D_PAD: tl.constexpr, PB: tl.constexpr, SPAN: tl.constexpr, PARTS: tl.constexpr,
            C_PAD: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr, RECENT: tl.constexpr, BITS: tl.constexpr,
            GROUP_MAX: tl.constexpr, UPDATE: tl.constexpr, P: tl.constexpr, PAGED: tl.constexpr, KP: tl.constexpr):
    row = tl.program_id(0)  # (sequence, KV head)
    part = tl.program_id(1)  # SPAN of its candidates: every part scores its own, the last to finish chooses
    b = row // HKV
    h = row % HKV
    if UPDATE and part == 0:  # the new token's page first; parts that read its bounds meanwhile rank it recent anyway
        _store_page(K, KMIN, KMAX, FIRST, LAST, TABLE, b, h, s_kb, s_kh, s_kt, s_mb, s_mh, s_mn, s_lb, s_tb, T, P, D,
                    D_PAD, PAGED, KP)
    for off in range(0, SPAN, PB):
        entry = part * SPAN + off + tl.arange(0, PB)
        pages = tl.load(CAND + b * s_cb + h * s_ch + entry, mask=entry < C, other=-1)
        score = _group_bounds(Q, KMIN, KMAX, b, h, pages, pages >= 0, s_qb, s_qh, s_mb, s_mh, s_mn, scale, G,
                              G_PAD, D, D_PAD, GROUP_MAX)
        tl.store(SCORES + row * C_PAD + entry, score, mask=entry < C)
    tl.debug_barrier()  # every thread's scores stored before the arrival is counted (released by the atomic)
    if tl.atomic_add(ARRIVED + row, 1, sem="acq_rel") == PARTS - 1:
        tl.store(ARRIVED + row, 0)  # every part has arrived: the counter is ready for the next launch
        i = tl.arange(0, C_PAD)
        cand = tl.load(CAND + b * s_cb + h * s_ch + i, mask=i < C, other=-1)
        live = cand >= 0
        last = tl.max(cand, 0)  # the new token's page: the recent pages are the candidates within RECENT of it
        # .cg: read the other parts' scores from L2, past this SM's L1
        x = tl.load(SCORES + row * C_PAD + i, mask=live, other=float("-inf"), cache_modifier=".cg")
        x = tl.where(live & (cand > last - RECENT), float("inf"), x)
        x = tl.where(live, x, float("-inf"))
        store_ascending(OUT + row * W, cand.to(tl.int32), top_w(x, W, BITS), W, W_PAD)


def refine_candidates(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, candidates: torch.Tensor,
                      scale: float, num_pages: int, recent_pages: int, group: str = "max",
                      new_page: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, Any] | None = None,
                      parts: int | None = None) -> torch.Tensor:
    """See :func:`rolecall.runtime.kernels.page_bounds.naive.refine_candidates`: one launch. ``parts`` programs per
    (sequence, KV head) each score their share of its candidates into a float32 scratch row; the last of them to
    finish chooses among all with the top-k kernel's rule (ties to the earlier entry). The pages come out in the
    candidates' order: ascending for a Δ-layer's choice on the GPU, and in any order the attention kernels read
    them.

    ``new_page = (key, first, last, page_size, block_table)`` updates the metadata of the new token's page first
    (:func:`update_page`) in the same launch: its bounds do not matter to the choice, since the newest page is
    always among the recent ones (``recent_pages ≥ 1``; with none, the update runs as its own launch first).

    ``parts`` defaults to one per 64 candidates: scoring in parallel instead of in one program's loop (H200,
    DS-Qwen-7B heads, 8 × 4 rows of 512 candidates: ``benchmarks/kernels.py --refine`` times 1 to 8 parts)."""
    b, hq, d = query.shape
    _, hkv, n, dk = kmin.shape
    c = candidates.shape[-1]
    if dk != d or hq % hkv or kmin.stride() != kmax.stride() or kmin.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError(f"query [B, {hq}, {d}] does not fit page metadata [B, {hkv}, n, {dk}] with unit last "
                         "strides (kmin and kmax alike)")
    if c > MAX_N or candidates.stride(-1) != 1:
        raise ValueError(f"{c} candidates per head (at most {MAX_N}, contiguous) do not fit one program; use the "
                         "reference")
    fused = new_page is not None and recent_pages >= 1
    if new_page is not None and not fused:
        update_page(kmin=kmin, kmax=kmax, **dict(zip(NEW_PAGE, new_page)))
    # unread unless fused; a new_page of four (no table) reads a contiguous cache
    key, first, last, page_size, table = (*new_page, None)[:5] if fused else (query[:, None], query, query, 1, None)
    if fused:
        _check_page_update(key, kmin, kmax, page_size)
        check_table(table, b)
    g, w, c_pad = hq // hkv, min(num_pages, c), triton.next_power_of_2(c)
    pb = min(64, max(16, c_pad))
    blocks = triton.cdiv(c, pb)
    parts = blocks if parts is None else max(1, min(parts, blocks))
    span = pb * triton.cdiv(blocks, parts)  # candidates a part scores, PB at a time
    parts = triton.cdiv(c, span)
    out = torch.empty(b, hkv, w, device=query.device, dtype=torch.int32)
    scratch = torch.empty(b * hkv, c_pad, device=query.device, dtype=torch.float32)
    _refine[(b * hkv, parts)](
        query, kmin, kmax, candidates, scratch, arrival_counters(query.device, b * hkv), out, key, first, last,
        _paged(key, table)[0], query.stride(0), query.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2),
        candidates.stride(0), candidates.stride(1), *_paged(key, table)[1:], row_stride(last) if fused else 0,
        *_table(key, table), c, float(scale), hkv, G=g,
        G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=max(16, triton.next_power_of_2(d)), PB=pb, SPAN=span,
        PARTS=parts, C_PAD=c_pad, W=w, W_PAD=triton.next_power_of_2(w), RECENT=recent_pages, BITS=2,
        GROUP_MAX=group == "max", UPDATE=fused, P=page_size, PAGED=table is not None, KP=key.shape[2],
        num_warps=8 if c_pad > 512 else 4,
    )
    return out
