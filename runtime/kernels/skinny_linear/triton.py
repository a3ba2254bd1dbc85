"""Triton kernel of :mod:`runtime.kernels.skinny_linear`: one program per ``BN`` output features, each streaming
its ``BN × K`` slice of the weight once (no split over K, so no second reduction kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.skinny_linear.naive import MAX_ROWS, Config, kernel_config


@triton.jit
def _skinny_linear(X, W, BIAS, Y, M, N, K, s_xm, s_wn, s_ym, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                   M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, M_PAD)
    n_ok = n < N
    if DOT:
        acc = tl.zeros([M_PAD, BN], tl.float32)
    else:  # one row: products summed over the tile's columns at the end (no 16-row padding)
        partial = tl.zeros([BN, BK], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        w = tl.load(W + n[:, None] * s_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            x = tl.load(X + m[:, None] * s_xm + k[None, :], mask=(m < M)[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        else:
            x = tl.load(X + k, mask=k_ok, other=0.0)
            partial += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if not DOT:
        acc = tl.sum(partial, 1)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * s_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=(m < M)[:, None] & n_ok[None, :])


@torch.library.custom_op("rolecall::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ weight.T + bias`` for ``M ≤ 16`` (see :func:`runtime.kernels.skinny_linear.linear`)."""
    config = kernel_config(x.shape[0], *weight.shape, x.element_size())
    if config is None or weight.shape[1] != x.shape[1]:
        raise ValueError(f"skinny_linear: no kernel for x {list(x.shape)} @ weight {list(weight.shape)}.T")
    return launch(x, weight, bias, config)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: Config) -> torch.Tensor:
    """The kernel with the given tiles (the tests run each kind)."""
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _skinny_linear[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else x, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, DOT=config.dot, M_PAD=MAX_ROWS, BN=config.block_n, BK=config.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=config.warps, num_stages=config.stages)
    return y


@skinny_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
