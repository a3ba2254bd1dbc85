"""Linear layers of a decode step: a few rows against a large weight, read once at memory speed.

``linear(x, weight, bias=None) -> y`` and ``gated_linear(x, weight, activation) -> act(x @ gate.T) · (x @ up.T)``
for an MLP's gate/up projection ``weight = [gate; up]``

============  ====================  ==========================================================
``x``         ``[..., K]``          the activations; a decode step has 1–64 rows
``weight``    ``[N, K]``            row-major, as ``torch.nn.Linear`` keeps it
``bias``      ``[N]`` or None
``y``         ``[..., N]``          ``x``'s dtype, accumulated in float32 and rounded once
============  ====================  ==========================================================

A decode step's GEMMs are matrix-vector products whose time is the weight's bytes over the memory bandwidth.
cuBLAS reaches 53–92 % of the copy bandwidth on a 7B model's projections at one row (its split-K variants add
a reduction kernel); the Triton kernel in ``triton.py`` — one program per ``BN`` output features streaming the
whole of ``K``, no split — reaches 70–102 % (H200, bf16; ``benchmarks/kernels.py --linear``). A long narrow
projection of a small model (too few feature tiles) splits ``K`` over programs instead, the last of which sums
the partials in the same launch. :func:`linear` takes the kernels on CUDA for up to :data:`MAX_ROWS` rows and for
the shapes where they measured faster (:func:`kernel_config`), in a compiled or graph-captured call (the decode
step, :func:`rolecall.runtime.kernels.kernel_call`), and ``F.linear`` everywhere else (the CPU, the prefill, an eager call,
whose launch through Triton costs the host several times cuBLAS's, most projections of a large batch).
``naive.py`` is the reference. The kernels are ``torch.library`` custom ops, so ``torch.compile`` keeps them inside
a compiled graph, and plain launches where a CUDA graph is captured outside it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rolecall.runtime.kernels import kernel_call, max_shared, use_triton
from rolecall.runtime.kernels.skinny_linear.naive import (
    GATED,
    MAX_ROWS,
    activation,
    kernel_config,
    skinny_linear,
)


def _kernel(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> Callable | None:
    """The Triton kernel's call (:func:`rolecall.runtime.kernels.kernel_call`) where this call takes it, else None: CUDA and
    not ``ROLECALL_KERNELS=naive``, a compiled or graph-captured call, 1 to :data:`MAX_ROWS` rows, and a shape where
    it measured faster and whose tiles fit the GPU (:func:`kernel_config`)."""
    if not use_triton(x):
        return None
    from rolecall.runtime.kernels.skinny_linear import triton  # registers the custom ops

    call = kernel_call(*(("skinny_gated", triton.gated_rows) if gated else ("skinny_linear", triton.linear_rows)))
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (call is None or not 0 < rows <= MAX_ROWS
            or kernel_config(rows, *weight.shape, x.element_size(), gated, max_shared(x)) is None):
        return None
    return call


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring."""
    call = _kernel(x, weight)
    if call is not None:
        return call(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``act(gate) · up`` of ``x @ weight.T``'s two halves. Where :func:`linear` would take the kernel (CUDA, a
    compiled or graph-captured call, up to :data:`MAX_ROWS` rows, a measured-faster shape) and the activation is one
    of :data:`GATED`, one kernel streams both halves and applies the activation before it writes (no activation
    kernel after it, half the output); elsewhere the projection, then the activation in ``x``'s dtype."""
    call = _kernel(x, weight, gated=True) if kind in GATED else None
    if call is not None:
        return call(x.reshape(-1, x.shape[-1]), weight, kind).view(*x.shape[:-1], weight.shape[0] // 2)
    gate, up = linear(x, weight).chunk(2, -1)
    return activation(gate, kind) * up


__all__ = ["GATED", "MAX_ROWS", "activation", "gated_linear", "kernel_config", "linear", "skinny_linear"]
