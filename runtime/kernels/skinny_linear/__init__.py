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
the shapes where they measured faster (:func:`kernel_config`), and ``F.linear`` everywhere else (the CPU, the
prefill, most projections of a large batch). ``naive.py`` is the reference. The kernels are ``torch.library``
custom ops, so ``torch.compile`` keeps them inside a compiled graph and CUDA graphs capture them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels import max_shared, op_or, use_triton
from runtime.kernels.skinny_linear.naive import GATED, MAX_ROWS, activation, kernel_config, skinny_linear


def _kernel_rows(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> int:
    """``x``'s rows when the call takes the Triton kernel (CUDA and not ``ROLECALL_KERNELS=naive``, 1 to
    :data:`MAX_ROWS` rows, a shape where it measured faster and whose tiles fit the GPU, :func:`kernel_config`),
    else 0."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (use_triton(x) and 0 < rows <= MAX_ROWS
            and kernel_config(rows, *weight.shape, x.element_size(), gated, max_shared(x)) is not None):
        return rows
    return 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring."""
    rows = _kernel_rows(x, weight)
    if rows:
        from runtime.kernels.skinny_linear import triton  # registers torch.ops.rolecall.skinny_linear

        y = op_or("skinny_linear", triton.linear_rows)(x.reshape(rows, x.shape[-1]), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``act(gate) · up`` of ``x @ weight.T``'s two halves. Where :func:`linear` would take the kernel (CUDA, up to
    :data:`MAX_ROWS` rows, a measured-faster shape) and the activation is one of :data:`GATED`, one kernel streams
    both halves and applies the activation before it writes (no activation kernel after it, half the output);
    elsewhere the projection, then the activation in ``x``'s dtype."""
    rows = _kernel_rows(x, weight, gated=True) if kind in GATED else 0
    if rows:
        from runtime.kernels.skinny_linear import triton  # registers torch.ops.rolecall.skinny_gated

        y = op_or("skinny_gated", triton.gated_rows)(x.reshape(rows, x.shape[-1]), weight, kind)
        return y.view(*x.shape[:-1], weight.shape[0] // 2)
    gate, up = linear(x, weight).chunk(2, -1)
    return activation(gate, kind) * up


__all__ = ["GATED", "MAX_ROWS", "activation", "gated_linear", "kernel_config", "linear", "skinny_linear"]
