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

``s_i = scale · q · k_i``. The reference in ``naive.py`` runs anywhere; on CUDA tensors the Triton kernel in
``triton.py`` (split-K over the chosen blocks, one pass per GQA group) runs instead and is tested against
the reference. ``ROLECALL_KERNELS=naive`` forces the reference everywhere.
"""

from __future__ import annotations

import torch

from rolecall.runtime.kernels import use_triton
from rolecall.runtime.kernels.sparse_attention import naive
from rolecall.runtime.kernels.sparse_attention.naive import expand_blocks, indices_to_mask


def sparse_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            indices: torch.Tensor | None = None, *, scale: float, block_size: int = 1,
                            log_weights: torch.Tensor | None = None,
                            key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, D] float32, lse [B, Hq] float32)``; see the table above."""
    impl = naive
    if use_triton(query):
        from rolecall.runtime.kernels.sparse_attention import triton as impl
    return impl.sparse_decode_attention(query, key, value, indices, scale=scale, block_size=block_size,
                                        log_weights=log_weights, key_mask=key_mask)


__all__ = ["expand_blocks", "indices_to_mask", "sparse_decode_attention", "use_triton"]
