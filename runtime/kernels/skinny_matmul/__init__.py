"""Skinny matmul for decode steps: ``skinny_linear(x, weight, bias=None) -> y``.

==========  ===================  ===============================================================
``x``       ``[..., K]``         at most 64 rows in all (a decode step's batch)
``weight``  ``[N, K]``           unit last stride (a projection as stored)
``bias``    ``[N]`` or None
``y``       ``[..., N]``         ``x · weightᵀ + bias`` in ``x``'s dtype, float32 accumulation
==========  ===================  ===============================================================

``naive.py`` is ``F.linear``; ``triton.py`` streams the weights for all rows at once (the engine uses it on
CUDA for steps of at most 64 rows, where cuBLAS reaches about 62 % of copy bandwidth on an H200).
"""

from runtime.kernels.skinny_matmul.naive import skinny_linear

__all__ = ["skinny_linear"]
