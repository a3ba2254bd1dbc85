"""Triton skinny matmul for decode: ``y [M, N] = x [M, K] · W [N, K]ᵀ (+ b)`` with M ≤ 64.

At decode time every projection reads its whole weight matrix for one to a few dozen rows, so the op is
bound by the weight bytes. Each program streams a ``[BLOCK_N, K / SPLIT]`` slab of W with 16-byte loads,
several tiles in flight (``num_stages``), and multiplies it with all M rows at once (``tl.dot`` with M padded
to 16), accumulating in float32. Small matrices (a 7B model's q/k/v and output projections are 25–33 MB)
split K over several programs so that every SM streams, and a second launch sums the float32 partials. The
tile shape is autotuned per (M, N, K) on first use (the engine's eager warm-up, before any graph capture).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_N = 32
_CONFIGS = [triton.Config({"BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bk in (128, 256, 512) for w in (4, 8) for s in (3, 4, 5)]


@triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "SPLIT"])
@triton.jit
def _skinny(X, W, B, Y, P, M, N, K, s_xm, s_wn, s_ym,
            SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    part = tl.program_id(1)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < M
    chunk = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_lo = part * chunk
    k_hi = tl.minimum(k_lo + chunk, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_hi
        w = tl.load(W + n[:, None] * s_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(X + m[:, None] * s_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + m[:, None] * s_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(P + (part * M + m[:, None]) * N + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_parts(P, B, Y, M, N, s_ym, SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(P + s * M * N + i, mask=ok, other=0.0)
    n = i % N
    if HAS_BIAS:
        acc += tl.load(B + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + (i // N) * s_ym + n, acc.to(Y.dtype.element_ty), mask=ok)


@functools.cache
def _sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_for(n: int, k: int, sms: int) -> int:
    """K splits: enough programs for about four per SM, each over at least 1024 of K."""
    blocks = triton.cdiv(n, BLOCK_N)
    split = 1
    while blocks * split < 4 * sms and k // (2 * split) >= 1024 and split < 16:
        split *= 2
    return split


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` (at most 64 rows in all) · ``weight [N, K]``ᵀ (+ ``bias [N]``) → ``[..., N]`` in x's dtype."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, n = rows.shape[0], weight.shape[0]
    if m > 64 or weight.stride(-1) != 1:
        raise ValueError(f"skinny_linear takes at most 64 rows with a unit last stride, got {m}")
    split = split_for(n, k, _sms(x.device.index or 0) if x.is_cuda else 8)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    parts = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else y
    b = bias if bias is not None else weight
    _skinny[(triton.cdiv(n, BLOCK_N), split)](rows, weight, b, y, parts, m, n, k, rows.stride(0), weight.stride(0),
                                               y.stride(0), SPLIT=split, BLOCK_M=max(16, triton.next_power_of_2(m)),
                                               BLOCK_N=BLOCK_N, HAS_BIAS=bias is not None)
    if split > 1:
        _sum_parts[(triton.cdiv(m * n, 1024),)](parts, b, y, m, n, y.stride(0), SPLIT=split, BLOCK=1024,
                                                 HAS_BIAS=bias is not None)
    return y.view(*x.shape[:-1], n)
