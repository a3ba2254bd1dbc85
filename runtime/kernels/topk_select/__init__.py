"""Top-k selection with a recency window, over tokens or pages.

``topk_with_recent(scores, k, recent, valid=None) -> indices``

=============  ======================  ===============================================================
argument       shape                   meaning
=============  ======================  ===============================================================
``scores``     ``[..., n]`` float      one score per token or page
``k``          int                     how many to keep in all (the recent ones included)
``recent``     int                     the last ``recent`` entries are always kept (when valid)
``valid``      ``[..., n]`` bool       False = never chosen (padding)
``indices``    ``[..., min(k, n)]``    ascending ids, -1 padded at the end when fewer are valid
=============  ======================  ===============================================================

``mask_to_indices(mask, width=None)`` turns a boolean selection ``[..., n]`` into the same padded form.
"""

from runtime.kernels.topk_select.naive import mask_to_indices, topk_with_recent

__all__ = ["mask_to_indices", "topk_with_recent"]
