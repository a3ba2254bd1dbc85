"""Top-k selection with a recency window, over tokens or pages.

``topk_with_recent(scores, k, recent, valid=None, last=None, ascending=True, positions=None) -> indices``

=============  ======================  ===============================================================
argument       shape                   meaning
=============  ======================  ===============================================================
``scores``     ``[..., n]`` float      one score per token or page
``k``          int                     how many to keep in all (the recent ones included)
``recent``     int                     the ``recent`` entries ending at ``last`` are always kept
``valid``      ``[..., n]`` bool       False = never chosen (padding)
``last``       ``[...]`` int or int    the last entry that exists (default ``n - 1``); later ones are
                                       never chosen (a static cache's unwritten slots)
``ascending``  bool                    False: the chosen ids in any order, -1 anywhere (no sort; the
                                       attention kernels do not care, the engine uses it)
``positions``  ``[..., n]`` int         what each entry stands for (default: its index; the pages of a
                                       candidate set): ``recent``, ``last`` and the returned ids are these
                                       (``last`` then defaults to the largest)
``indices``    ``[..., min(k, n)]``    ascending ids, -1 padded at the end when fewer can be chosen
=============  ======================  ===============================================================

The one selection rule of calibration (``topk_mask_with_recent``, the same choice as a boolean ``[..., n]``),
the reference policies and the engine's graph-captured step: no host sync, fixed output width. On the GPU the
engine runs the same choice in Triton (``triton.py``, rows up to ``MAX_N`` scores): one program a row, or several
when few rows leave the GPU idle.
``mask_to_indices(mask, width=None)`` turns a boolean selection ``[..., n]`` into the padded form.
"""

from rolecall.runtime.kernels.topk_select.naive import (
    mask_to_indices,
    topk_mask_with_recent,
    topk_with_recent,
)

__all__ = ["mask_to_indices", "topk_mask_with_recent", "topk_with_recent"]
