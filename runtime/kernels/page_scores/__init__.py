"""Page scores of a Δ-layer (DELTA): ``S[u] = Σ_{t in page u} max_h p_h[t]``.

``page_scores(query, key, scale, page_size, key_mask=None) -> scores``

==============  ==========================  ===========================================================
argument        shape                       meaning
==============  ==========================  ===========================================================
``query``       ``[B, Hq, D]``              one decode query per sequence, after RoPE
``key``         ``[B, Hkv, T, D]``          the cache
``key_mask``    ``[B or 1, T]`` bool        False = not attended (left padding)
``scores``      ``[B, ceil(T / P)]`` f32    per page the sum over its tokens of the max over all query
                                            heads of the softmax probability
==============  ==========================  ===========================================================

``decode_and_score(query, key, value, scale, page_size, key_mask=None, per_kv_head=False) -> (out, lse,
scores)``: dense decode attention and the page scores of the same pass (``[B, pages]``, or ``[B, Hkv, pages]``
with the max taken over each KV head's query group); ``triton.py`` does it in one pass over K/V.

Also exported: ``attention_probs`` (``[B, Hq, T]``), ``head_max_probs`` (``[B, T]``) and ``pool_pages``
(sum consecutive ``page_size`` entries of the last axis).
"""

from rolecall.runtime.kernels.page_scores.naive import (
    attention_probs,
    decode_and_score,
    head_max_probs,
    page_scores,
    pool_pages,
)

__all__ = ["attention_probs", "decode_and_score", "head_max_probs", "page_scores", "pool_pages"]
