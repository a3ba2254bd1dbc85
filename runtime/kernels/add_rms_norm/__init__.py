"""The residual add and the RMS norm after it, in one pass over the row.

``add_rms_norm(x, o, weight, eps, o_weight=None) -> (x + o, rms_norm(x + o) · weight)``

==============  ==============  ===============================================================
``x``           ``[..., N]``    the residual stream
``o``           ``[..., N]``    what a block adds to it (normed by ``o_weight`` first when given,
                                as Gemma 3 norms its attention and MLP outputs)
``weight``      ``[N]``         the next norm's weight
returns         ``[..., N]``    the new residual stream (``x``'s dtype) and its normed copy
==============  ==============  ===============================================================

Between a layer's GEMMs the decode step runs two of these. In its compiled graph on CUDA (or in a CUDA graph
captured without torch.compile, :func:`rolecall.runtime.kernels.kernel_call`) it is the Triton kernel in ``triton.py``
(unless ``ROLECALL_KERNELS=naive``), one program per row, launched with programmatic dependent launch
(:mod:`rolecall.runtime.kernels.pdl`), which lets the projection after it be placed while it runs; a ``torch.compile``-fused
add and norm cannot take part in that chain. It computes in float32 and rounds once per output; the sum is rounded
to ``x``'s dtype before it is normed, as the reference's two steps do. ``naive.py`` is the reference and the CPU
path.

An eager call (the prefill, also when a prefill graph captures it, as its first eager pass ran) runs the reference,
an add and PyTorch's fused RMS norm, which measured faster there, where the host's launching bounds a short pass: a
SmolLM2-135M-shaped prefill of one row on an H100 (two runs, alternating in one process, medians of ten): 40 tokens
34.8/27.7 → 31.1/24.5 ms, 1,024 tokens 31.3/25.1 → 23.3/19.9 ms, 4,096 tokens 29.2/21.9 → 19.7/16.9 ms
(``benchmarks/results/prefill_add_norm_h100.json``).
"""

from __future__ import annotations

import torch

from rolecall.runtime.kernels import kernel_call, use_triton
from rolecall.runtime.kernels.add_rms_norm.naive import add_rms_norm as reference


def add_rms_norm(x: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float,
                 o_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    n = x.shape[-1]
    call = None
    if use_triton(x) and n and x.numel():
        from rolecall.runtime.kernels.add_rms_norm import triton  # registers torch.ops.rolecall.add_rms_norm

        call = kernel_call("add_rms_norm", triton.add_norm_rows)
    if call is None:
        return reference(x, o, weight, eps, o_weight)
    rows = x.numel() // n
    x2, h = call(x.reshape(rows, n).contiguous(), o.reshape(rows, n).contiguous(), weight, eps, o_weight)
    return x2.view(x.shape), h.view(x.shape)


__all__ = ["add_rms_norm", "reference"]
