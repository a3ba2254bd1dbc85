"""The new token's projections → rotary-embedded query, and its key and value written into the cache.

``rope_and_store(y, heads, kv_heads, cos, sin, k_cache, v_cache, slot, q_norm=None, k_norm=None, eps=1e-6,
order=None, block_table=None) -> query``

=================  ===========================  =======================================================
``y``              ``[B, (Hq + 2 Hkv) · D]``    the fused q/k/v projection of one token per row
``cos``, ``sin``   ``[B, D]``                   the row's RoPE tables; ``sin`` signed (its first half
                                                negated), so rotating half a head is one roll
``k_cache``,       ``[B, Hkv, S, D]``           the cache; slot ``slot`` is written: a device scalar,
``v_cache``                                     or ``[B]``, each row's own (a sliding layer's ring)
``q_norm``,        ``[D]`` or None              per-head RMS norms applied before RoPE (Qwen3, Gemma 3)
``k_norm``
``order``          ``[Hkv]`` int32 or None      the cache's head order: stored KV head j is the model's
                                                head ``order[j]`` (the query comes in that order too)
``block_table``    ``[B, W]`` int32 or None     a paged cache: ``k_cache``, ``v_cache`` are pools
                                                ``[N, Hkv, P, D]`` and slot s of row b is offset
                                                ``s % P`` of page ``block_table[b, s // P]``
``query``          ``[B, Hq, D]``               in ``y``'s dtype
=================  ===========================  =======================================================

``split_rope`` is the arithmetic alone (``[..., (Hq + 2 Hkv) · D]`` → q, k, v), which the prefill and the
reference decode step share. On the GPU the engine runs the Triton kernel in ``triton.py``: one launch for
what is otherwise two RoPE kernels and two cache writes per layer. It computes in float32 and rounds once
per output, as ``torch.compile`` fuses the reference.
"""

from rolecall.runtime.kernels.rope_cache.naive import rope_and_store, split_rope

__all__ = ["rope_and_store", "split_rope"]
