"""Sparse decode attention over a set of tokens or blocks per (batch, KV head).

``sparse_decode_attention(query, key, value, indices=None, *, scale, block_size=1, log_weights=None,
key_mask=None) -> (out, lse)``

====================  ======================  ===========================================================
argument              shape                   meaning
====================  ======================  ===========================================================
``query``             ``[B, Hq, D]``          one decode query per sequence, after RoPE
``key``, ``value``    ``[B, Hkv, T, D]``      the cache; query head h reads KV head ``h // (Hq / Hkv)``
``indices``           ``[B, Hkv, N]`` int     block ids (token ids when ``block_size == 1``), -1 = padding;
                                              ``None`` = every token. No id may repeat in a row.
``log_weights``       ``[B, Hkv, N]`` float   added to the logit of every token of the entry: a token of
                                              weight w counts as w copies (vAttention's ``n_s / b``)
``key_mask``          ``[B or 1, T]`` bool    False = never read (left padding, evicted slots)
``out``               ``[B, Hq, D]`` float32  ``Σ w_i e^{s_i} v_i / Σ w_i e^{s_i}`` over the read tokens
``lse``               ``[B, Hq]`` float32     ``log Σ w_i e^{s_i}`` (-inf and ``out = 0`` for an empty set)
====================  ======================  ===========================================================

``s_i = scale · q · k_i``. The reference in ``naive.py`` runs anywhere; a GPU kernel will sit behind this
same function and be tested against it.
"""

from runtime.kernels.sparse_attention.naive import expand_blocks, indices_to_mask, sparse_decode_attention

__all__ = ["expand_blocks", "indices_to_mask", "sparse_decode_attention"]
