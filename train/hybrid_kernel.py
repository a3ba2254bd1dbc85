"""The student's hybrid attention as fused Triton kernels: :func:`hybrid_layer` without its ``[B, Hq, S, T]``
float32 tensors.

:func:`rolecall.train.hybrid.hybrid_layer` is the reference. It writes the scores, the probabilities, the
masked probabilities and, in the backward pass, their gradients, each a float32 ``[B, Hq, S, T]`` tensor
(1 GB a layer for 730 span queries over 10K keys on an 8B model), and recomputes them under checkpointing.
Here each query block streams over the keys once, as flash attention does, and carries two online softmaxes
side by side: one over every key it may read (full attention) and one over the inherited set only (sparse
attention, exact however small the set's share of the probability). What a layer writes is

- the two outputs ``[B, Hkv, G·S, D]`` and their log-sum-exps ``[B, Hkv, G·S]`` (float32), the only tensors
  kept for the backward pass;
- the group's mean probability ``[B, Hkv, S, T]`` (float32), from which the next layer's set is taken: the
  same top-k as the reference's.

The backward pass recomputes the scores tile by tile: one kernel a key block (∂K, ∂V), one a query block (∂Q).
The output is ``O = z·O_full + (1 − z)·O_sparse`` a KV head; with ``P`` the full and ``Q`` the sparse
probabilities and ``g = ∂O · Vᵀ`` (one product serves both)::

    ∂S = z·P ∘ (g − ⟨∂O, O_full⟩) + (1 − z)·Q ∘ (g − ⟨∂O, O_sparse⟩)
    ∂V = (z·P + (1 − z)·Q)ᵀ ∂O,   ∂K = scale · ∂Sᵀ q,   ∂Q = scale · ∂S k,   ∂z = Σ ⟨∂O, O_full − O_sparse⟩

Products run in the inputs' dtype with float32 accumulation (bf16 probabilities times values, as flash
attention does); scores, softmax statistics and outputs are float32. Head sizes that are not a power of two
are padded inside the kernel. Under ``TRITON_INTERPRET=1`` the kernels run on the CPU, which the tests use.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _tile(ptr, base, idx, idx_ok, d, d_ok, D):
    """Rows ``idx`` of a [N, D] matrix at ``ptr + base`` as a [len(idx), DP] tile (zeros past either end)."""
    return tl.load(ptr + base + idx[:, None] * D + d[None, :], mask=idx_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _flags(ptr, base, srow, cols, rows_ok, n_ok, T):
    """A [rows, keys] tile of a bool [S, T] mask at ``ptr + base`` (False past either end)."""
    return tl.load(ptr + base + srow[:, None] * T + cols[None, :], mask=rows_ok[:, None] & n_ok[None, :], other=0) != 0


@triton.jit
def _query_block(H, R, S, D, BM: tl.constexpr, DP: tl.constexpr):
    """A program's (batch, KV head) and block of query rows: which rows exist, each row's query position, and
    the head-size lanes with which of them exist."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    d = tl.arange(0, DP)
    return bh // H, bh % H, bh, rows, rows < R, rows % S, d, d < D


@triton.jit
def _keys(K, V, KEEP, SEL, kv_base, keep_base, sel_base, n0, srow, rows_ok, d, d_ok, D, T,
          BN: tl.constexpr, SPARSE: tl.constexpr):
    """The keys and values of the block from ``n0`` and the two masks over it (``sel`` is ``keep`` without a
    sparse part)."""
    cols = n0 + tl.arange(0, BN)
    n_ok = cols < T
    k = _tile(K, kv_base, cols, n_ok, d, d_ok, D)
    v = _tile(V, kv_base, cols, n_ok, d, d_ok, D)
    keep = _flags(KEEP, keep_base, srow, cols, rows_ok, n_ok, T)
    sel = keep
    if SPARSE:
        sel = _flags(SEL, sel_base, srow, cols, rows_ok, n_ok, T)
    return k, v, keep, sel


@triton.jit
def _online(m, total, acc, s, v):
    """One step of an online softmax: the running max, sum and weighted values after the tile ``s``."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing to read yet stays at zero
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    total = total * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, total, acc


@triton.jit
def _fwd(Q, K, V, KEEP, SEL, OF, OS, LF, LS,
         sq_b, sq_h, sk_b, sk_h, skeep_b, ssel_b, ssel_h,
         H, R, S, T, D, scale,
         DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPARSE: tl.constexpr):
    b, h, bh, rows, rows_ok, srow, d, d_ok = _query_block(H, R, S, D, BM, DP)
    q = _tile(Q, b * sq_b + h * sq_h, rows, rows_ok, d, d_ok, D)
    m_f = tl.full([BM], float("-inf"), tl.float32)
    l_f = tl.zeros([BM], tl.float32)
    acc_f = tl.zeros([BM, DP], tl.float32)
    m_s = tl.full([BM], float("-inf"), tl.float32)
    l_s = tl.zeros([BM], tl.float32)
    acc_s = tl.zeros([BM, DP], tl.float32)
    for n0 in range(0, T, BN):
        k, v, keep, sel = _keys(K, V, KEEP, SEL, b * sk_b + h * sk_h, b * skeep_b, b * ssel_b + h * ssel_h, n0, srow,
                                rows_ok, d, d_ok, D, T, BN, SPARSE)
        s = tl.where(keep, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_f, l_f, acc_f = _online(m_f, l_f, acc_f, s, v)
        if SPARSE:
            m_s, l_s, acc_s = _online(m_s, l_s, acc_s, tl.where(sel, s, float("-inf")), v)
    out = b * sq_b + h * sq_h + rows[:, None] * D + d[None, :]
    stat = bh * R + rows
    l_f = tl.where(rows_ok, l_f, 1.0)  # rows past the end: nothing stored, nothing divided by zero
    l_s = tl.where(rows_ok, l_s, 1.0)
    tl.store(OF + out, acc_f / l_f[:, None], mask=rows_ok[:, None] & d_ok[None, :])
    tl.store(LF + stat, m_f + tl.log(l_f), mask=rows_ok)
    if SPARSE:
        tl.store(OS + out, acc_s / l_s[:, None], mask=rows_ok[:, None] & d_ok[None, :])
        tl.store(LS + stat, m_s + tl.log(l_s), mask=rows_ok)


@triton.jit
def _mean_probs(Q, K, KEEP, LF, PM, sq_b, sq_h, sk_b, sk_h, skeep_b,
                H, G, R, S, T, D, scale,
                DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The group's mean probability of each (query position, key): [B, H, S, T] float32."""
    pid_s, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    srow = pid_s * BM + tl.arange(0, BM)
    s_ok = srow < S
    cols = pid_n * BN + tl.arange(0, BN)
    n_ok = cols < T
    d = tl.arange(0, DP)
    d_ok = d < D
    k = _tile(K, b * sk_b + h * sk_h, cols, n_ok, d, d_ok, D)
    keep = _flags(KEEP, b * skeep_b, srow, cols, s_ok, n_ok, T)
    acc = tl.zeros([BM, BN], tl.float32)
    for g in range(0, G):
        q = _tile(Q, b * sq_b + h * sq_h, g * S + srow, s_ok, d, d_ok, D)
        lse = tl.load(LF + bh * R + g * S + srow, mask=s_ok, other=0.0)
        acc += tl.exp(tl.where(keep, tl.dot(q, tl.trans(k)) * scale - lse[:, None], float("-inf")))
    tl.store(PM + bh * S * T + srow[:, None] * T + cols[None, :], acc / G, mask=s_ok[:, None] & n_ok[None, :])


@triton.jit
def _row_block(Q, DO, LF, LS, DF, DS, base, bh, rows, rows_ok, d, d_ok, D, R, SPARSE: tl.constexpr):
    """What the backward pass needs of a block of query rows: q, ∂O (in q's dtype), and the two softmaxes'
    log-sum-exps and ⟨∂O, O⟩ terms (the sparse ones are the full ones' without a sparse part)."""
    q = _tile(Q, base, rows, rows_ok, d, d_ok, D)
    do = _tile(DO, base, rows, rows_ok, d, d_ok, D).to(q.dtype)
    lf = tl.load(LF + bh * R + rows, mask=rows_ok, other=0.0)
    df = tl.load(DF + bh * R + rows, mask=rows_ok, other=0.0)
    ls, ds = lf, df
    if SPARSE:
        ls = tl.load(LS + bh * R + rows, mask=rows_ok, other=0.0)
        ds = tl.load(DS + bh * R + rows, mask=rows_ok, other=0.0)
    return q, do, lf, ls, df, ds


@triton.jit
def _probs(q, k, v, do, z, lf, ls, df, ds, keep, sel, scale, SPARSE: tl.constexpr):
    """A tile's mixed probabilities ``z·P + (1 − z)·Q`` (what multiplies V) and the score gradient ∂S (float32)."""
    s = tl.dot(q, tl.trans(k)) * scale
    p = tl.exp(tl.where(keep, s - lf[:, None], float("-inf")))  # masked before exp: no overflow to hide
    g = tl.dot(do, tl.trans(v))
    if SPARSE:
        p_s = tl.exp(tl.where(sel, s - ls[:, None], float("-inf")))
        mixed = z * p + (1 - z) * p_s
        dsc = z * p * (g - df[:, None]) + (1 - z) * p_s * (g - ds[:, None])
    else:
        mixed = p
        dsc = p * (g - df[:, None])
    return mixed, dsc


@triton.jit
def _bwd_kv(Q, K, V, KEEP, SEL, DO, Z, LF, LS, DF, DS, DK, DV,
            sq_b, sq_h, sk_b, sk_h, skeep_b, ssel_b, ssel_h,
            H, R, S, T, D, scale,
            DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPARSE: tl.constexpr):
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    cols = pid_n * BN + tl.arange(0, BN)
    n_ok = cols < T
    d = tl.arange(0, DP)
    d_ok = d < D
    k = _tile(K, b * sk_b + h * sk_h, cols, n_ok, d, d_ok, D)
    v = _tile(V, b * sk_b + h * sk_h, cols, n_ok, d, d_ok, D)
    z = tl.load(Z + h)
    dk = tl.zeros([BN, DP], tl.float32)
    dv = tl.zeros([BN, DP], tl.float32)
    for m0 in range(0, R, BM):
        rows = m0 + tl.arange(0, BM)
        rows_ok = rows < R
        srow = rows % S
        q, do, lf, ls, df, ds = _row_block(Q, DO, LF, LS, DF, DS, b * sq_b + h * sq_h, bh, rows, rows_ok, d, d_ok,
                                           D, R, SPARSE)
        keep = _flags(KEEP, b * skeep_b, srow, cols, rows_ok, n_ok, T)
        sel = keep
        if SPARSE:
            sel = _flags(SEL, b * ssel_b + h * ssel_h, srow, cols, rows_ok, n_ok, T)
        mixed, dsc = _probs(q, k, v, do, z, lf, ls, df, ds, keep, sel, scale, SPARSE)
        dv += tl.dot(tl.trans(mixed.to(q.dtype)), do)
        dk += tl.dot(tl.trans(dsc.to(q.dtype)), q)
    kv = b * sk_b + h * sk_h + cols[:, None] * D + d[None, :]
    tl.store(DK + kv, dk * scale, mask=n_ok[:, None] & d_ok[None, :])
    tl.store(DV + kv, dv, mask=n_ok[:, None] & d_ok[None, :])


@triton.jit
def _bwd_q(Q, K, V, KEEP, SEL, DO, Z, LF, LS, DF, DS, DQ,
           sq_b, sq_h, sk_b, sk_h, skeep_b, ssel_b, ssel_h,
           H, R, S, T, D, scale,
           DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPARSE: tl.constexpr):
    b, h, bh, rows, rows_ok, srow, d, d_ok = _query_block(H, R, S, D, BM, DP)
    q, do, lf, ls, df, ds = _row_block(Q, DO, LF, LS, DF, DS, b * sq_b + h * sq_h, bh, rows, rows_ok, d, d_ok, D, R,
                                       SPARSE)
    z = tl.load(Z + h)
    dq = tl.zeros([BM, DP], tl.float32)
    for n0 in range(0, T, BN):
        k, v, keep, sel = _keys(K, V, KEEP, SEL, b * sk_b + h * sk_h, b * skeep_b, b * ssel_b + h * ssel_h, n0, srow,
                                rows_ok, d, d_ok, D, T, BN, SPARSE)
        _, dsc = _probs(q, k, v, do, z, lf, ls, df, ds, keep, sel, scale, SPARSE)
        dq += tl.dot(dsc.to(q.dtype), k)
    at = b * sq_b + h * sq_h + rows[:, None] * D + d[None, :]
    tl.store(DQ + at, dq * scale, mask=rows_ok[:, None] & d_ok[None, :])


# Tiles (query rows, keys, warps, pipeline stages) a program of each kernel takes, fastest first: the first ones
# are the best of a sweep on an H200 at head size 128 (8B shape, 730 queries over 10,730 keys), where they took
# the forward from 7.9 to 2.5 ms a layer, ∂K∂V from 5.9 to 4.3 and ∂Q from 3.8 to 2.1 against 64 × 64, 4 warps,
# 2 stages (∂K∂V and ∂Q then 3.0 and 1.9 ms once one product ∂O·Vᵀ served both softmaxes:
# benchmarks/results/train_step_profile_h200.txt); a GPU with less shared memory takes the first that fits. The
# interpreter runs 16 × 16.
_TILES = {
    "forward": [(64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 2), (32, 32, 4, 1)],
    "dkdv": [(64, 32, 4, 2), (32, 32, 4, 1)],
    "dq": [(64, 32, 4, 3), (64, 32, 4, 2), (32, 32, 4, 1)],
    "mean": [(64, 64, 4, 2), (32, 32, 4, 1)],
}
_FITS: dict[tuple, int] = {}  # (kernel, device, head size, dtype) → the first tile that launched


def _launch(name: str, kernel, grid, q: Tensor, *args, **meta) -> None:
    """Launch ``kernel`` with the first of its tiles that fits the GPU; ``grid(rows, keys)`` gives the grid."""
    if not q.is_cuda:
        kernel[grid(16, 16)](*args, BM=16, BN=16, num_warps=1, **meta)
        return
    key = (name, q.device.index, q.shape[-1], q.dtype)
    tiles = _TILES[name]
    for i in range(_FITS.get(key, 0), len(tiles)):
        bm, bn, warps, stages = tiles[i]
        try:
            kernel[grid(bm, bn)](*args, BM=bm, BN=bn, num_warps=warps, num_stages=stages, **meta)
        except triton.runtime.errors.OutOfResources:
            if i == len(tiles) - 1:
                raise
            continue
        _FITS[key] = i
        return


def _strides(q: Tensor, k: Tensor, keep: Tensor, sel: Tensor | None) -> tuple[int, ...]:
    ssel = (sel.stride(0), sel.stride(1)) if sel is not None else (0, 0)
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), keep.stride(0) if keep.shape[0] > 1 else 0, *ssel)


class _Hybrid(torch.autograd.Function):
    """(q, k, v, z, keep, sel, scale, groups) → (``z·O_full + (1 − z)·O_sparse``, the group's mean probability);
    z is a tensor either way; with ``sel`` None the output is the full attention's and the kernels ignore z."""

    @staticmethod
    def forward(ctx, q, k, v, z, keep, sel, scale, groups):
        b, hkv, r, d = q.shape
        s, t = keep.shape[1], k.shape[2]
        o_f = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        o_s = torch.empty_like(o_f) if sel is not None else o_f.new_empty(0)
        l_f = torch.empty((b, hkv, r), dtype=torch.float32, device=q.device)
        l_s = torch.empty_like(l_f) if sel is not None else l_f
        dp = triton.next_power_of_2(d)
        _launch("forward", _fwd, lambda bm, bn: (triton.cdiv(r, bm), b * hkv), q,
                q, k, v, keep, sel if sel is not None else keep, o_f, o_s, l_f, l_s, *_strides(q, k, keep, sel),
                hkv, r, s, t, d, scale, DP=dp, SPARSE=sel is not None)
        mean = torch.empty((b, hkv, s, t), dtype=torch.float32, device=q.device)
        _launch("mean", _mean_probs, lambda bm, bn: (triton.cdiv(s, bm), triton.cdiv(t, bn), b * hkv), q,
                q, k, keep, l_f, mean, *_strides(q, k, keep, None)[:5], hkv, groups, r, s, t, d, scale, DP=dp)
        out = o_f
        if sel is not None:
            zg = z.float().view(1, hkv, 1, 1)
            out = zg * o_f + (1 - zg) * o_s
        ctx.save_for_backward(q, k, v, z, keep, sel, o_f, o_s, l_f, l_s)
        ctx.scale = scale
        ctx.mark_non_differentiable(mean)
        ctx.set_materialize_grads(False)
        return out, mean

    @staticmethod
    def backward(ctx, do, _mean):
        q, k, v, z, keep, sel, o_f, o_s, l_f, l_s = ctx.saved_tensors
        if do is None:
            return None, None, None, None, None, None, None, None
        sparse = sel is not None
        do = do.contiguous()
        d_f = (do * o_f).sum(-1)  # ⟨∂O, O⟩ a row, for each softmax: its backward term
        d_s = (do * o_s).sum(-1) if sparse else d_f
        dz = (do * (o_f - o_s)).sum((0, 2, 3)).to(z.dtype) if sparse and ctx.needs_input_grad[3] else None
        b, hkv, r, d = q.shape
        s, t = keep.shape[1], k.shape[2]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        args = (q, k, v, keep, sel if sparse else keep, do, z.float().contiguous(), l_f, l_s, d_f, d_s)
        common = (*_strides(q, k, keep, sel), hkv, r, s, t, d, ctx.scale)
        meta = dict(DP=triton.next_power_of_2(d), SPARSE=sparse)
        _launch("dkdv", _bwd_kv, lambda bm, bn: (triton.cdiv(t, bn), b * hkv), q, *args, dk, dv, *common, **meta)
        _launch("dq", _bwd_q, lambda bm, bn: (triton.cdiv(r, bm), b * hkv), q, *args, dq, *common, **meta)
        return dq, dk, dv, dz, None, None, None, None


def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, z: Tensor | None, keep: Tensor, sparse_keep: Tensor | None,
                     scale: float) -> tuple[Tensor, Tensor]:
    """The hybrid output ``z·full + (1 − z)·sparse`` (float32 ``[B, Hkv, G·S, D]``, differentiable in q, k, v and
    z) and the group's mean probability ``[B, Hkv, S, T]`` float32 (no gradient).

    q [B, Hkv, G·S, D]: the query heads of a KV head stacked, query position fastest; k, v [B, Hkv, T, D];
    z [Hkv], the gates; keep [B|1, S, T] bool, True where a query may read a key; sparse_keep [B, Hkv, S, T] bool,
    the keys sparse attention reads (within ``keep``, at least one a row), or None for full attention only (z is
    then not read).
    """
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    keep8 = keep.contiguous().view(torch.uint8)
    sel8 = sparse_keep.contiguous().view(torch.uint8) if sparse_keep is not None else None
    if z is None:
        z = torch.ones(k.shape[1], dtype=torch.float32, device=q.device)
    # Triton launches on the current device: a layer on another GPU (a device map) makes that one current
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        return _Hybrid.apply(q, k, v, z, keep8, sel8, scale, q.shape[2] // keep.shape[1])
