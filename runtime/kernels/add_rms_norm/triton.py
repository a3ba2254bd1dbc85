"""Triton kernel of :mod:`rolecall.runtime.kernels.add_rms_norm`: one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rolecall.runtime.kernels import pdl


@triton.jit
def _add_rms_norm(X, ADD, ADD_W, W, X_OUT, H, N, s_x, s_o, s_xo, s_h, eps, HAS_ADD_W: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.let_next_start(PDL)  # the next kernel may be placed at once: it waits for this one to complete
    pdl.wait(PDL)
    r = tl.program_id(0)
    n = tl.arange(0, BLOCK)
    ok = n < N
    o = tl.load(ADD + r * s_o + n, mask=ok, other=0.0)
    dtype = X_OUT.dtype.element_ty
    o = o.to(tl.float32)
    if HAS_ADD_W:  # o normed first, rounded as the reference's norm returns it
        o = o * tl.rsqrt(tl.sum(o * o, 0) / N + eps) * tl.load(ADD_W + n, mask=ok, other=0.0).to(tl.float32)
        o = o.to(dtype).to(tl.float32)
    x = (tl.load(X + r * s_x + n, mask=ok, other=0.0).to(tl.float32) + o).to(dtype)
    tl.store(X_OUT + r * s_xo + n, x, mask=ok)
    x = x.to(tl.float32)
    h = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps) * tl.load(W + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(H + r * s_h + n, h.to(dtype), mask=ok)


def add_norm_rows(x: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float,
                  o_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See :mod:`rolecall.runtime.kernels.add_rms_norm`; ``x`` and ``o`` are ``[rows, N]`` with a unit last stride."""
    rows, n = x.shape
    if o.shape != x.shape or x.stride(-1) != 1 or o.stride(-1) != 1:
        raise ValueError(f"add_rms_norm: x {list(x.shape)} and o {list(o.shape)} must be equal [rows, N] with a "
                         "unit last stride")
    x_out, h = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(n)
    _add_rms_norm[(rows,)](
        x, o, o_weight if o_weight is not None else weight, weight, x_out, h, n, x.stride(0), o.stride(0),
        x_out.stride(0), h.stride(0), float(eps), HAS_ADD_W=o_weight is not None, BLOCK=block,
        num_warps=4 if block <= 2048 else 8, **pdl.options(x.device))
    return x_out, h


@torch.library.custom_op("rolecall::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float,
                 o_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_norm_rows` as the custom op that torch.compile calls (:func:`rolecall.runtime.kernels.kernel_call`)."""
    return add_norm_rows(x, o, weight, eps, o_weight)


@add_rms_norm.register_fake
def _(x: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float,
      o_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)
