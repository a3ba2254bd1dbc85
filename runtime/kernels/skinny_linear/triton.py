"""Triton kernels of :mod:`rolecall.runtime.kernels.skinny_linear`: one program per ``BN`` output features, each streaming
its ``BN × K`` slice of the weight once (no split over K, so no second reduction kernel). Gated (an MLP's
gate/up projection): the program streams the same ``BN`` features of both halves and writes ``act(gate) · up``.
Split (a long narrow projection, too few feature tiles to stream its weight at the bandwidth): ``SPLIT``
programs share a feature tile's columns, and the last of them to finish sums their partials
(:mod:`rolecall.runtime.kernels.arrivals`) in the same launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rolecall.runtime.kernels import max_shared, pdl
from rolecall.runtime.kernels.arrivals import arrival_counters
from rolecall.runtime.kernels.skinny_linear.naive import TILE_ROWS, Config, kernel_config

SILU, GELU_TANH = 1, 2  # GATED: the gate's activation


@triton.jit
def _skinny_linear(X, W, BIAS, Y, M, N, K, s_xm, s_wn, s_ym, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                   M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                   GATED: tl.constexpr = 0, PDL: tl.constexpr = False):
    """GATED (SILU or GELU_TANH): W holds 2N rows, the gate's N then the up's N, and Y gets ``act(gate) · up``,
    each half rounded to Y's dtype first, as the two halves of one projection would be."""
    pdl.let_next_start(PDL)  # the next kernel may be placed at once: it waits for this one to complete
    pdl.wait(PDL)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, M_PAD)
    n_ok = n < N
    if DOT:
        acc = tl.zeros([M_PAD, BN], tl.float32)
        if GATED:
            acc_up = tl.zeros([M_PAD, BN], tl.float32)
    else:  # one row: products summed over the tile's columns at the end (no 16-row padding)
        partial = tl.zeros([BN, BK], tl.float32)
        if GATED:
            partial_up = tl.zeros([BN, BK], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        w = tl.load(W + n[:, None] * s_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if GATED:
            w_up = tl.load(W + (n + N)[:, None] * s_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            x = tl.load(X + m[:, None] * s_xm + k[None, :], mask=(m < M)[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
            if GATED:
                acc_up += tl.dot(x, tl.trans(w_up), input_precision=PRECISION)
        else:
            x = tl.load(X + k, mask=k_ok, other=0.0)
            partial += w.to(tl.float32) * x.to(tl.float32)[None, :]
            if GATED:
                partial_up += w_up.to(tl.float32) * x.to(tl.float32)[None, :]
    if not DOT:
        acc = tl.sum(partial, 1)[None, :]
        if GATED:
            acc_up = tl.sum(partial_up, 1)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gate = acc.to(Y.dtype.element_ty).to(tl.float32)
        up = acc_up.to(Y.dtype.element_ty).to(tl.float32)
        if GATED == 1:  # SILU: g · σ(g)
            acc = gate * tl.sigmoid(gate) * up
        else:  # GELU_TANH: ½ g (1 + tanh(√(2/π)(g + 0.044715 g³))) = g · σ(2√(2/π)(g + 0.044715 g³))
            acc = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
    tl.store(Y + m[:, None] * s_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=(m < M)[:, None] & n_ok[None, :])


@triton.jit
def _split_linear(X, W, BIAS, Y, PART, ARRIVED, M, N, K, s_xm, s_wn, s_ym, HAS_BIAS: tl.constexpr,
                  M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr,
                  SPLIT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    """Program (tile, part) multiplies columns ``part · SPAN`` up to ``SPAN`` more (a multiple of BK, so every
    tile's columns start aligned) and stores its float32 partial; the last program of the tile to arrive sums
    the SPLIT partials in part order (the same sum whichever arrives last), adds the bias and writes Y."""
    pdl.let_next_start(PDL)  # as in _skinny_linear
    pdl.wait(PDL)
    tile = tl.program_id(0)
    part = tl.program_id(1)
    n = tile * BN + tl.arange(0, BN)
    m = tl.arange(0, M_PAD)
    n_ok = n < N
    acc = tl.zeros([M_PAD, BN], tl.float32)
    for i in range(0, SPAN, BK):
        k = part * SPAN + i + tl.arange(0, BK)
        k_ok = k < K
        w = tl.load(W + n[:, None] * s_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(X + m[:, None] * s_xm + k[None, :], mask=(m < M)[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    cell = m[:, None] * BN + tl.arange(0, BN)[None, :]
    tl.store(PART + (tile * SPLIT + part) * (M_PAD * BN) + cell, acc)
    tl.debug_barrier()  # every thread's partial stored before the arrival is counted (released by the atomic)
    if tl.atomic_add(ARRIVED + tile, 1, sem="acq_rel") == SPLIT - 1:
        tl.store(ARRIVED + tile, 0)  # every part has arrived: the counter is ready for the next launch
        total = tl.zeros([M_PAD, BN], tl.float32)
        for s in tl.static_range(0, SPLIT):
            total += tl.load(PART + (tile * SPLIT + s) * (M_PAD * BN) + cell, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + m[:, None] * s_ym + n[None, :], total.to(Y.dtype.element_ty),
                 mask=(m < M)[:, None] & n_ok[None, :])


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ weight.T + bias`` for ``M ≤ 64`` (see :func:`rolecall.runtime.kernels.skinny_linear.linear`)."""
    config = kernel_config(x.shape[0], *weight.shape, x.element_size(), shared=max_shared(x))
    if config is None or weight.shape[1] != x.shape[1]:
        raise ValueError(f"skinny_linear: no kernel for x {list(x.shape)} @ weight {list(weight.shape)}.T")
    return launch(x, weight, bias, config)


@torch.library.custom_op("rolecall::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`linear_rows` as the custom op that torch.compile calls (:func:`rolecall.runtime.kernels.kernel_call`)."""
    return linear_rows(x, weight, bias)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: Config,
           gated: str | None = None) -> torch.Tensor:
    """The kernel with the given tiles (the tests run each kind). ``gated`` (an activation of
    :data:`~rolecall.runtime.kernels.skinny_linear.naive.GATED`): ``act(gate) · up`` of the weight's two halves, each program
    over half as many features of both, so it streams the same bytes a tile."""
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    block_n = config.block_n
    if gated is not None:
        if bias is not None or n % 2:
            raise ValueError(f"a gated projection takes no bias and an even number of rows, got {n}")
        n, block_n = n // 2, max(16 if config.dot else 1, config.block_n // 2)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    m_pad = max(TILE_ROWS, triton.next_power_of_2(m))  # 16, 32 or 64 rows in each tl.dot
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    if config.split > 1:
        if gated is not None or not config.dot:
            raise ValueError("a split kernel is a plain projection over tl.dot tiles")
        tiles = triton.cdiv(n, block_n)
        span = config.block_k * triton.cdiv(triton.cdiv(k, config.split), config.block_k)
        parts = torch.empty(tiles * config.split, m_pad * block_n, device=x.device, dtype=torch.float32)
        _split_linear[(tiles, config.split)](
            x, weight, bias if bias is not None else x, y, parts, arrival_counters(x.device, tiles), m, n, k,
            x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, M_PAD=m_pad, BN=block_n,
            BK=config.block_k, SPAN=span, SPLIT=config.split, PRECISION=precision, num_warps=config.warps,
            num_stages=config.stages, **pdl.options(x.device))
        return y
    _skinny_linear[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else x, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, DOT=config.dot, M_PAD=m_pad, BN=block_n, BK=config.block_k,
        PRECISION=precision,
        GATED={None: 0, "silu": SILU, "gelu_pytorch_tanh": GELU_TANH}[gated],
        num_warps=config.warps, num_stages=config.stages, **pdl.options(x.device))
    return y


def gated_rows(x: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(x @ gate.T) · (x @ up.T)`` for ``weight = [gate; up]`` and ``M ≤ 64`` rows (see
    :func:`rolecall.runtime.kernels.skinny_linear.gated_linear`)."""
    config = kernel_config(x.shape[0], *weight.shape, x.element_size(), gated=True, shared=max_shared(x))
    if config is None or weight.shape[1] != x.shape[1]:
        raise ValueError(f"skinny_gated: no kernel for x {list(x.shape)} @ weight {list(weight.shape)}.T")
    return launch(x, weight, None, config, gated=activation)


@torch.library.custom_op("rolecall::skinny_gated", mutates_args=())
def skinny_gated(x: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
    """:func:`gated_rows` as the custom op that torch.compile calls (:func:`rolecall.runtime.kernels.kernel_call`)."""
    return gated_rows(x, weight, activation)


@skinny_gated.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


@skinny_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
