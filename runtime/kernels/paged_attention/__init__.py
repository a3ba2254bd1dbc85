"""Decode attention over a paged KV cache: each sequence's keys live in pages of a shared pool, found through its
block table.

``paged_decode_attention(query, key_pages, value_pages, table, lengths, *, scale, indices=None, block_size=1,
log_weights=None) -> (out, lse)``; ``write_tokens(key_pages, value_pages, table, positions, key, value)``;
``gather_pages(pages, table) -> [B, Hkv, W * P, D]``.

=========================  ======================  ======================================================
argument                   shape                   meaning
=========================  ======================  ======================================================
``query``                  ``[B, Hq, D]``          one decode query per sequence, after RoPE
``key_pages``, ``value…``  ``[N, Hkv, P, D]``      the pool: page ``n`` holds ``P`` consecutive tokens
``table``                  ``[B, W]`` int          the pages of each sequence in token order (logical page
                                                   ``j`` is physical page ``table[b, j]``), null-padded
``lengths``                ``[B]`` int             tokens each sequence holds (it reads tokens ``< length``)
``indices`` …              as in sparse attention  logical token or block ids (a block of ``P`` tokens is
                                                   one page); ``None`` = every token
``positions``              ``[B]`` int             the logical slot each sequence's new token is written to
``key``, ``value``         ``[B, Hkv, D]``         the new token's K and V
=========================  ======================  ======================================================

``out`` and ``lse`` are those of :func:`rolecall.runtime.kernels.sparse_attention.sparse_decode_attention` over
the sequence's tokens in logical order: a paged cache and a contiguous one holding the same tokens give the same
result. The reference in ``naive.py`` gathers the pages and calls the sparse reference; it is the truth a kernel
that reads the pages in place is tested against.
"""

from __future__ import annotations

from rolecall.runtime.kernels.paged_attention.naive import gather_pages, paged_decode_attention, write_tokens

__all__ = ["gather_pages", "paged_decode_attention", "write_tokens"]
