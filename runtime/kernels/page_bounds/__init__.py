"""Quest's page metadata and bounds: per-page key minima and maxima, and from them an upper bound of any
token's logit in the page.

=====================================================  ====================================================
``page_minmax(key, keep, page_size)``                  ``[B, Hkv, T, D]``, readable ``[B, T]`` →
                                                       ``(kmin, kmax)`` ``[B, Hkv, ceil(T / P), D]``
``page_bounds(query, kmin, kmax, scale)``              ``[B, Hq, n]`` bounds, ``-inf`` for empty pages
``page_scores(query, kmin, kmax, scale, group)``       ``[B, Hkv, n]``: the bounds of each KV head's query
                                                       group, combined by ``"max"`` or ``"sum"``
``update_page(key, kmin, kmax, first, last, P,        recompute, in place, the page holding slot ``last``
block_table=None)``                                    from the keys in ``first[b]..last`` (a pool of pages
                                                       read through ``block_table``)
``refine_candidates(query, kmin, kmax, candidates,     ``[B, Hkv, C]`` ascending candidate pages (a Δ-layer's
scale, K, L, new_page=None)``                          choice) → each KV head's ``K`` best by ``page_scores``,
                                                       its last ``L`` always: ``[B, Hkv, min(K, C)]``; with
                                                       ``new_page = (key, first, last, P, table)`` after
                                                       ``update_page`` (one launch on the GPU)
=====================================================  ====================================================

The references are in ``naive.py``; the engine's step runs ``page_scores``, ``update_page`` and
``refine_candidates`` from ``triton.py`` on the GPU (one launch each, instead of two float32 matrix products and a
dozen small kernels).
"""

from rolecall.runtime.kernels.page_bounds.naive import (
    page_bounds,
    page_minmax,
    page_scores,
    refine_candidates,
    update_page,
)

__all__ = ["page_bounds", "page_minmax", "page_scores", "refine_candidates", "update_page"]
