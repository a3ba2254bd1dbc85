"""Triton block-sparse GQA decode attention (split-K flash decoding over a chosen set of blocks).

Same contract as :func:`rolecall.runtime.kernels.sparse_attention.naive.sparse_decode_attention`, plus ``full_rows``:

=================  ========================  =======================================================
``query``          ``[B, Hq, D]``            one decode query per sequence
``key``/``value``  ``[B, Hkv, T, D]``        the cache, read in place (any strides with unit last stride)
``indices``        ``[B, Hkv, N]`` int       block ids, −1 = padding, or ``None`` = every token
``log_weights``    ``[B, Hkv, N]`` float     added to the logits of every token of the entry
``key_mask``       ``[B or 1, T]`` bool      False = never read
``full_rows``      ``[B, Hkv]`` bool         rows that read every token instead of their indices, so
                                             retrieval (full) heads and sparse heads share one launch
``index_rows``     ``[Hkv]`` int             KV head h reads ``indices[:, index_rows[h]]`` (and its log
                                             weights): sets kept in another head order, read in place
``out``            ``[B, Hq, D]``            where the output goes (any strides with unit last stride:
                                             a slice of a larger output), instead of a new tensor
``out_heads``      ``[Hkv]`` int32           KV head h's query heads go to ``out``'s group ``out_heads[h]``
                                             (``out`` then ``[B, H · G, D]``, any H): a cache kept in
                                             another head order answers in the model's
=================  ========================  =======================================================

Returns ``out [B, Hq, D]`` (``out_dtype``, float32 by default) and ``lse [B, Hq]`` float32.

How it works: one program per (sequence, KV head, chunk of ``chunk`` tokens of that row's read set). All
``Hq / Hkv`` query heads of the group share each K/V tile (one HBM read serves the whole group, the point of
GQA decoding). Tiles are gathered rows of the cache, so token sets (block size 1) and block sets (16, 64) use
the same code. Rows that read fewer tokens have fewer busy chunks; idle programs exit after writing an empty
partial, so full and sparse heads in one launch are balanced by construction: every busy program does the
same amount of work. A small combine step merges the chunk partials by their log-sum-exp; where each row is one
chunk, its program writes the output itself and no merge is launched: :func:`choose_launch` makes each row one
program, in 128-token tiles three stages deep, where the rows are many (a large batch such as DELTA's 64
sequences, or eight of a model with eight KV heads reading every token); see there for what was measured.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from rolecall.runtime.kernels import max_shared, pdl, peak_bandwidth, sm_count
from rolecall.runtime.kernels.paged_attention.tables import check_table

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile(j0, end, m_i, l_i, acc, q, k_base, v_base, IDX, LOGW, KMASK, b, hi, full, s_ib, s_ih, s_mb, s_kt, s_vt,
          T, scale, lg_base, s_gh, first, last, keep_logits, pages, s_kp, s_vp, G: tl.constexpr, G_PAD: tl.constexpr,
          D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
          HAS_IDX: tl.constexpr, HAS_LOGW: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_SPAN: tl.constexpr,
          WRITE_LOGITS: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """One tile of TILE tokens of the row's read set: gather K/V rows, update the online softmax state. ``PAGED``:
    token ``tok`` of the row sits at offset ``tok % PAGE`` of page ``pages[tok // PAGE]`` (the row's block table)."""
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    j = j0 + tl.arange(0, TILE)
    live = j < end
    if HAS_IDX:
        entry = j // BS
        is_full = (tl.zeros([TILE], tl.int32) + full) != 0  # as a bool tensor: masks must be tensors
        blk = tl.load(IDX + b * s_ib + hi * s_ih + entry, mask=live & ~is_full, other=-1)
        tok = tl.where(is_full, j, blk * BS + j % BS)
        valid = live & (is_full | (blk >= 0)) & (tok < T)
    else:
        tok = j
        valid = live
    if HAS_KMASK:
        valid = valid & (tl.load(KMASK + b * s_mb + tok, mask=valid, other=0) != 0)
    if HAS_SPAN:
        valid = valid & (tok >= first) & (tok <= last)
    if PAGED:
        page = tl.load(pages + tok // PAGE, mask=valid, other=0).to(tl.int64)
        k_at = page * s_kp + (tok % PAGE) * s_kt
        v_at = page * s_vp + (tok % PAGE) * s_vt
    else:
        k_at = tok * s_kt
        v_at = tok * s_vt
    k = tl.load(k_base + k_at[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale  # [G_PAD, TILE] fp32
    if HAS_LOGW:
        w = tl.load(LOGW + b * s_ib + hi * s_ih + entry, mask=valid & ~is_full, other=0.0)
        s += w.to(tl.float32)[None, :]
    s = tl.where(valid[None, :], s, float("-inf"))
    if WRITE_LOGITS:  # a selection layer keeps its logits (2 or 4 bytes per head and token, vs 2·D·2 of K/V)
        g = tl.arange(0, G_PAD)
        keep = live & ((tl.zeros([TILE], tl.int32) + keep_logits) != 0)  # the first LOGIT_HEADS KV heads' rows
        if HAS_IDX:  # a mixed launch: only the rows that read everything keep theirs
            keep = keep & is_full
        tl.store(lg_base + g[:, None] * s_gh + tok[None, :], s, mask=(g < G)[:, None] & keep[None, :])
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with nothing valid keeps the state
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    v = tl.load(v_base + v_at[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _sparse_decode_partial(
    Q, K, V, IDX, IROWS, LOGW, KMASK, FIRST, LAST, FULL, OUT, OHEADS, LSE, LOGITS, TABLE,
    s_qb, s_qh,
    s_kb, s_kh, s_kt,
    s_vb, s_vh, s_vt,
    s_tb, s_kp, s_vp,
    s_ib, s_ih,
    s_mb,
    s_ob, s_oh, s_os, s_og,
    s_lb, s_lh, s_ls,
    s_gb, s_gh, s_last,
    T, N, HKV, LOGIT_HEADS, scale, chunk,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BS: tl.constexpr, TILE: tl.constexpr, CHUNK: tl.constexpr,
    HAS_IDX: tl.constexpr, HAS_LOGW: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_SPAN: tl.constexpr,
    HAS_FULL: tl.constexpr, WRITE_LOGITS: tl.constexpr, STATIC_BOUNDS: tl.constexpr, HAS_IROWS: tl.constexpr,
    HAS_OHEADS: tl.constexpr, PDL: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    hi = h  # the row of the indices (and log weights) this KV head reads
    if HAS_IROWS:  # the head maps are read before the wait: no kernel of the step writes them
        hi = tl.load(IROWS + h)
    ho = h  # the output's group of this KV head (its own, or OHEADS[h] where the program writes the output)
    if HAS_OHEADS:
        ho = tl.load(OHEADS + h)
    pdl.wait(PDL)

    # full = 1: this row reads every token (a retrieval head, or no indices at all)
    if HAS_IDX:
        if HAS_FULL:
            full = tl.load(FULL + row).to(tl.int32)
        else:
            full = 0
    else:
        full = 1
    n_tok = full * T + (1 - full) * N * BS
    start = split * chunk
    end = tl.minimum(start + chunk, n_tok)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < G
    d_ok = d < D
    q = tl.load(Q + b * s_qb + (h * G + g)[:, None] * s_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [G_PAD, D_PAD]

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    k_base = K + b * s_kb + h * s_kh  # a paged cache: s_kb = s_vb = 0, and the row's pages say where its tokens are
    v_base = V + b * s_vb + h * s_vh
    pages = TABLE + b * s_tb
    lg_base = LOGITS + b * s_gb + h * G * s_gh
    keep_logits = (h < LOGIT_HEADS).to(tl.int32)
    first = 0
    last = T
    if HAS_SPAN:  # the row's valid slots are first..last: no mask to read
        first = tl.load(FIRST + b)
        last = tl.load(LAST + b * s_last)  # one for all rows (stride 0) or each row's own
        # a row that reads every token stops at its last slot: the tiles past it (a cache larger than the row's
        # context: a scheduler's rows, a kept decoder's rounded slots) would load nothing and still cost their loop
        end = tl.minimum(end, full * (last + 1).to(tl.int32) + (1 - full) * end)  # int32: the loop's index math
    if STATIC_BOUNDS:  # Triton's CPU interpreter cannot loop over runtime bounds (NumPy >= 2): CHUNK = chunk there
        for off in range(0, CHUNK, TILE):
            m_i, l_i, acc = _tile(start + off, end, m_i, l_i, acc, q, k_base, v_base, IDX, LOGW, KMASK,
                                  b, hi, full, s_ib, s_ih, s_mb, s_kt, s_vt, T, scale, lg_base, s_gh, first, last,
                                  keep_logits, pages, s_kp, s_vp,
                                  G, G_PAD, D, D_PAD, BS, TILE, HAS_IDX, HAS_LOGW, HAS_KMASK, HAS_SPAN,
                                  WRITE_LOGITS, PAGED, PAGE)
    else:
        for j0 in range(start, end, TILE):
            m_i, l_i, acc = _tile(j0, end, m_i, l_i, acc, q, k_base, v_base, IDX, LOGW, KMASK,
                                  b, hi, full, s_ib, s_ih, s_mb, s_kt, s_vt, T, scale, lg_base, s_gh, first, last,
                                  keep_logits, pages, s_kp, s_vp,
                                  G, G_PAD, D, D_PAD, BS, TILE, HAS_IDX, HAS_LOGW, HAS_KMASK, HAS_SPAN,
                                  WRITE_LOGITS, PAGED, PAGE)

    pdl.let_next_start(PDL)  # the merge's programs may be placed while the last ones finish
    busy = l_i > 0
    out = acc / tl.where(busy, l_i, 1.0)[:, None]
    lse = tl.where(busy, m_i + tl.log(tl.where(busy, l_i, 1.0)), float("-inf"))
    o_ptr = OUT + b * s_ob + ho * s_oh + split * s_os + g[:, None] * s_og + d[None, :]
    tl.store(o_ptr, out, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(LSE + b * s_lb + h * s_lh + split * s_ls + g, lse, mask=g_ok)


def tokens_of(key: torch.Tensor, block_table: torch.Tensor | None = None) -> int:
    """Tokens a row of the cache ``key`` holds in logical order: ``T`` of a contiguous ``[B, Hkv, T, D]``, or ``W · P``
    of a pool ``[N, Hkv, P, D]`` read through a ``[B, W]`` ``block_table``."""
    return key.shape[2] * (block_table.shape[1] if block_table is not None else 1)


def _next_pow2(x: int, floor: int = 16) -> int:
    return max(floor, 1 << (x - 1).bit_length())


def choose_chunk(tokens: int, rows: int, sms: int, dense: bool = True, tile: int = 64) -> int:
    """Tokens per program of a call of few rows (:func:`choose_launch`), a multiple of ``tile``: each row's
    ``tokens`` split evenly over enough programs to fill the GPU about four times over, at least 256 tokens each
    for rows that stream the cache and 128 for gathered sets, whose programs wait on their block ids (a 2K-token
    set of 16-token pages at 128K × 8, DS-Qwen-7B heads, H200: 12.5 µs a layer at 128 vs 14.2 at 256).

    Even splits, not a power of two: rounding a chunk up to one halved the programs of some shapes (H200, whole
    call with the merge: DS-Qwen-1.5B heads at 18K × 64, dense, 300.8 µs with 3 chunks of 8,192 against 280.8
    with 4 of 4,608; 10 % of 64-token blocks at 128K × 8, 8 KV heads, 110.8 against 109.0 µs). The chunk is a
    runtime argument of the kernel, so a new length compiles nothing. One wave of longer programs in 128-token
    tiles was faster for the 7B's 4 KV heads at batch 1 and slower for Llama's 8 (H200, 128K × 8: 1.050 vs
    0.963 ms; 128K × 1: 0.151 vs 0.132), so 64-token tiles and four waves stay."""
    splits = max(1, round(4 * sms / max(rows, 1)))
    chunk = max(256 if dense else 128, math.ceil(tokens / splits))
    return tile * math.ceil(chunk / tile)


# rows of (sequence, KV head), as a share of the SMs, from which each row is one program (choose_launch): from 93
# rows on 132 SMs. In the decode step of 7B heads (H100, full): 64 rows 17.06 ms one program a row against 15.31
# split, 96 rows 20.78 / 20.98, 128 rows 15.63 / 15.87; of 1.5B heads (delta, 1K budget, 16K, its sparse layers
# gathered): 96 rows 3.67 / 3.74, 128 rows 4.23 / 4.34
ROW_PROGRAMS = 0.7
# bytes a second one program streams a dense row at, 128-token tiles three stages deep, inside a decode step: 2.56 TB/s
# over 64 programs (Llama-3-8B heads at 32K × 8, H100, 420 µs a layer against 355 split), so rows that stream the
# cache are one program each only where that many programs reach the GPU's peak bandwidth (choose_launch)
DENSE_ROW_BANDWIDTH = 40e9


def shared_bytes(tile: int, stages: int, head_dim: int, itemsize: int) -> int:
    """Shared memory the partial kernel may take, at most: the K and V tiles of every stage in flight after the
    first, and the rest (the query, block ids, layout conversions) bounded by 16 KB plus 16 rows of a head. Compiled
    for sm80–sm90 (Triton 3.6 and 3.9, head dims 64–256, 2- and 4-byte caches) the rest took 6–24 KB: 139,264
    bytes for 128-token tiles, three stages, head dim 128, bf16."""
    d_pad = _next_pow2(head_dim)
    return (stages - 1) * tile * d_pad * itemsize * 2 + 16 * 1024 + 16 * d_pad * itemsize


def choose_launch(tokens: int, rows: int, sms: int, dense: bool = True, head_dim: int = 128, itemsize: int = 2,
                  shared: int | None = None, bandwidth: float | None = None) -> tuple[int, int, int]:
    """``(chunk, tile, stages)`` of a call whose ``rows`` each read ``tokens`` (``dense``: every token of the cache,
    else a gathered set) of ``head_dim``-wide heads of ``itemsize`` bytes, on a GPU whose programs may take
    ``shared`` bytes of shared memory (None: no limit) and whose memory peaks at ``bandwidth`` bytes a second
    (:func:`rolecall.runtime.kernels.peak_bandwidth`; None: not known).

    Many rows are one program each, in 128-token tiles three stages deep: no merge to launch, and half as many
    steps of the tile loop, each with twice the bytes in flight. That takes rows from :data:`ROW_PROGRAMS` of the
    SMs on, and rows that stream the cache also as many as stream the peak ``bandwidth`` at
    :data:`DENSE_ROW_BANDWIDTH` each (84 rows on an H100 SXM, 120 on an H200 at its rated 4.8 TB/s); both only
    where the tiles fit in ``shared`` (:func:`shared_bytes`: not for head dim 256 or a float32 cache on an H100,
    nor head dim 128 on sm86/sm89). Fewer rows split, as :func:`choose_chunk` says, in 64-token tiles two stages
    deep.

    The thresholds come from the decode step (``benchmarks/decode.py``), not from calls timed alone: in a graph of
    calls of one kernel, a call of fewer programs than SMs runs beside the next (each lets the next start early),
    which a step's next kernel, reading its output, does not. So ``python -m benchmarks.kernels --no-attention
    --many-rows`` (H100, DS-Qwen and Llama-3-8B heads, graph of 16 calls,
    ``benchmarks/results/kernels_rows_h100.json``), one program a row against the split launch and its merge, µs,
    flatters one program a row below the SMs' count
    (dense, 64 rows of Llama-3-8B heads at 32K tokens: 351 µs alone, 420 in the step, where FlashInfer's call
    takes 355, and the whole step 19.30 ms against 17.25 with the split launch):

    * gathered, 1,024 tokens of 16-token pages (DELTA's sparse layers): 1.5B heads at 64 rows × 2 KV heads 28.2
      against 33.7, 48 × 2 22.8 / 26.9, 32 × 2 17.8 / 19.9, 16 × 2 14.9 / 9.6; 7B heads at 64 × 4 52.8 / 59.8;
      2,048 tokens at 48 × 2 40.4 / 45.3, at 32 × 2 32.6 / 32.3 and 16 × 4 35.7 / 32.4; 10 % of the 64-token
      blocks of 128K (13,120 tokens) at 8 × 8 (Llama-3-8B heads) 159.6 / 153.3; single tokens (Lethe's and
      vAttention's sets, a later run, ``kernels_rows_tokens_h100.json``), 1,024 of them at 64 × 2 29.2 / 33.0,
      48 × 2 24.1 / 26.8, 32 × 2 20.0 / 19.8;
    * dense (also keeping their logits, as a Δ-layer does): 1.5B heads at 64 × 2, 512 tokens 14.7 / 19.7, 18,432
      390.9 / 404.5 (keeping logits 421.4 / 437.8); at 32 × 2, 512 tokens 10.3 / 14.9, 18,432 201.5 / 205.2;
      7B heads at 64 × 4, 18,432 tokens 780.4 / 803.4; Llama-3-8B heads at 8 × 8, 131,072 tokens 1396.6 /
      1414.0."""
    fits = shared is None or shared_bytes(128, 3, head_dim, itemsize) <= shared
    many = max(ROW_PROGRAMS * sms, (bandwidth or 0) / DENSE_ROW_BANDWIDTH if dense else 0)
    if fits and rows >= many:
        return 128 * math.ceil(max(tokens, 1) / 128), 128, 3
    tile = split_tile(head_dim, itemsize, shared)
    return choose_chunk(tokens, rows, sms, dense, tile), tile, 2


def split_tile(head_dim: int, itemsize: int, shared: int | None) -> int:
    """Tokens a tile of the split launch (two stages): 64, or 32 where 64 would not fit ``shared`` bytes (heads of 256
    in a float32 cache on sm86/sm89: 151,552 bytes compiled against 101,376)."""
    return next((tile for tile in (64, 32) if shared is None or shared_bytes(tile, 2, head_dim, itemsize) <= shared), 16)


def sparse_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            indices: torch.Tensor | None = None, *, scale: float, block_size: int = 1,
                            log_weights: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
                            full_rows: torch.Tensor | None = None, chunk: int | None = None,
                            tile: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                            logits_out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                            key_span: tuple[torch.Tensor, torch.Tensor] | None = None,
                            index_rows: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, out_heads: torch.Tensor | None = None,
                            logit_heads: int | None = None,
                            block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of the reference; see the module docstring for shapes.

    ``block_table [B, W]`` int32: the cache is paged (:mod:`rolecall.runtime.kernels.paged_attention`): ``key`` and
    ``value`` are pools ``[N, Hkv, P, D]`` and row b's token t sits at offset ``t % P`` of page ``block_table[b, t //
    P]``, read in place; every other argument speaks of the row's ``T = W · P`` tokens in logical order, as for a
    contiguous cache holding the same tokens (which gives the same result).

    ``chunk`` (tokens a program), ``tile`` and ``num_stages``: left None, :func:`choose_launch` picks all three;
    where ``tile`` or ``num_stages`` is given, or the call mixes ``full_rows``, :func:`choose_chunk` picks the
    chunk and the others default to :func:`split_tile`'s tiles (64 tokens where they fit) two stages deep.

    ``logits_out``: a float32 or float16 ``[B, logit_heads · G, T]`` buffer that receives every scaled logit
    (−inf where masked) of the first ``logit_heads`` KV heads' query heads (default: every KV head) among the
    rows that read everything (a dense call: all rows; with ``full_rows``: those rows, the others' entries are
    left as they are), so a selection layer or a retrieval head scores pages without reading K again.
    """
    b, hq, d = query.shape
    _, hkv, t, dk = key.shape
    page = 1
    if block_table is not None:
        page = t
        check_table(block_table, b)
        block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
        t = block_table.shape[1] * page
    if dk != d or hq % hkv:
        raise ValueError(f"query [B, {hq}, {d}] does not fit key [B, {hkv}, T, {dk}]")
    if indices is None and (log_weights is not None or full_rows is not None or index_rows is not None):
        raise ValueError("log_weights, full_rows and index_rows need indices (without indices every row reads "
                         "every token)")
    for name, rows in (("index_rows", index_rows), ("out_heads", out_heads)):
        if rows is not None and (rows.shape != (hkv,) or rows.dtype != torch.int32):
            raise ValueError(f"{name} must be int32 [{hkv}], got {rows.dtype} {list(rows.shape)}")
    g = hq // hkv
    logit_heads = hkv if logit_heads is None else logit_heads
    if not 0 < logit_heads <= hkv:
        raise ValueError(f"logit_heads must be 1 to {hkv} (the KV heads), got {logit_heads}")
    if logits_out is not None and ((indices is not None and full_rows is None)
                                   or logits_out.shape != (b, logit_heads * g, t)
                                   or logits_out.dtype not in (torch.float32, torch.float16)
                                   or logits_out.stride(-1) != 1):
        raise ValueError(f"logits_out must be a float32 or float16 [B, logit_heads · G, T] = [{b}, {logit_heads * g}, "
                         f"{t}] buffer of a dense call or a call with full_rows")
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    n = 0 if indices is None else indices.shape[-1]
    sparse_read = t if indices is None else n * block_size  # tokens a sparse row reads
    max_read = t if (indices is None or full_rows is not None) else sparse_read
    # Size chunks by the sparse rows, so they too spread over many programs; full rows just take more.
    if chunk is None and tile is None and num_stages is None and full_rows is None:
        chunk, tile, num_stages = choose_launch(sparse_read, b * hkv, sm_count(query), dense=indices is None,
                                                head_dim=d, itemsize=key.element_size(), shared=max_shared(query),
                                                bandwidth=peak_bandwidth(query))
    tile = tile or split_tile(d, key.element_size(), max_shared(query))
    num_stages = num_stages or 2
    if chunk is None:
        chunk = choose_chunk(sparse_read, b * hkv, sm_count(query), dense=indices is None, tile=tile)
    chunk = tile * max(1, triton.cdiv(chunk, tile))  # whole tiles: a program's tiles never cross into the next's
    splits = max(1, triton.cdiv(max_read, chunk))
    if splits == 1:  # each row in one program (short rows, or enough rows to fill the GPU): it writes the output
        # and log-sum-exp itself, through views of them shaped as the partials; no merge to launch
        out = _output(out, b, hq, d, query.device, out_dtype, g if out_heads is not None else None)
        lse = torch.empty(b, hq, device=query.device, dtype=torch.float32)
        out_p = out.as_strided((b, hkv, 1, g, d), (out.stride(0), g * out.stride(1), 0, out.stride(1), 1))
        lse_p = lse.view(b, hkv, 1, g)
    else:
        out_p = torch.empty(b, hkv, splits, g, d, device=query.device, dtype=torch.float32)
        lse_p = torch.empty(b, hkv, splits, g, device=query.device, dtype=torch.float32)
    dummy = query  # stands in for absent optional tensors (never read)
    idx = None
    if indices is not None:  # any strides over (B, Hkv): a set shared by every head stays an expanded view
        shared_strides = log_weights is None and indices.dtype == torch.int32 and indices.stride(-1) == 1
        idx = indices if shared_strides else indices.to(torch.int32).contiguous()  # log-weights share idx's strides
    logw = log_weights.float().contiguous() if log_weights is not None else None
    km = key_mask.to(torch.int8).contiguous() if key_mask is not None else None
    fr = full_rows.to(torch.int8).contiguous() if full_rows is not None else None
    first, last = key_span if key_span is not None else (dummy, dummy)
    _sparse_decode_partial[(b * hkv, splits)](
        query, key, value,
        idx if idx is not None else dummy, index_rows if index_rows is not None else dummy,
        logw if logw is not None else dummy,
        km if km is not None else dummy, first, last, fr if fr is not None else dummy,
        out_p, out_heads if out_heads is not None and splits == 1 else dummy, lse_p,
        logits_out if logits_out is not None else out_p, block_table if block_table is not None else dummy,
        query.stride(0), query.stride(1),
        0 if block_table is not None else key.stride(0), key.stride(1), key.stride(2),
        0 if block_table is not None else value.stride(0), value.stride(1), value.stride(2),
        block_table.stride(0) if block_table is not None else 0, key.stride(0), value.stride(0),
        idx.stride(0) if idx is not None else 0, idx.stride(1) if idx is not None else 0,
        (km.stride(0) if km.shape[0] > 1 else 0) if km is not None else 0,
        out_p.stride(0), out_p.stride(1), out_p.stride(2), out_p.stride(3),
        lse_p.stride(0), lse_p.stride(1), lse_p.stride(2),
        logits_out.stride(0) if logits_out is not None else 0, logits_out.stride(1) if logits_out is not None else 0,
        last.stride(0) if last.dim() else 0,
        t, n, hkv, logit_heads, float(scale), chunk,
        G=g, G_PAD=_next_pow2(g), D=d, D_PAD=_next_pow2(d), BS=block_size, TILE=tile,
        CHUNK=chunk if INTERPRETING else 0,
        HAS_IDX=idx is not None, HAS_LOGW=logw is not None, HAS_KMASK=km is not None,
        HAS_SPAN=key_span is not None, HAS_FULL=fr is not None,
        WRITE_LOGITS=logits_out is not None, STATIC_BOUNDS=INTERPRETING, HAS_IROWS=index_rows is not None,
        HAS_OHEADS=out_heads is not None and splits == 1, PAGED=block_table is not None, PAGE=page,
        num_warps=num_warps, num_stages=num_stages, **pdl.options(query.device),
    )
    if splits == 1:
        return out, lse
    return combine_partials(out_p, lse_p, out_dtype, out=out, out_heads=out_heads)


@triton.jit
def _combine(OUT_P, LSE_P, OUT, OHEADS, LSE, s_ob, s_oh, s_os, s_og, s_lb, s_lh, s_ls, s_yb, s_yh, HKV, G, S,
             SB: tl.constexpr, D: tl.constexpr, DB: tl.constexpr, HAS_OHEADS: tl.constexpr, PDL: tl.constexpr):
    """One (sequence, query head, DB of its D dims): merge its S partials, SB at a time (usually all at once),
    by an online log-sum-exp (each block rescales what came before)."""
    pid = tl.program_id(0)
    part = tl.program_id(1)
    b = pid // (HKV * G)
    h = (pid // G) % HKV
    g = pid % G
    ho = h
    if HAS_OHEADS:  # read before the wait: no kernel of the step writes the map
        ho = tl.load(OHEADS + h)
    pdl.wait(PDL)
    d = part * DB + tl.arange(0, DB)
    lse_base = LSE_P + b * s_lb + h * s_lh + g
    m = tl.max(tl.full([SB], float("-inf"), tl.float32), 0)  # 0-d float32 tensors: the loop's carried state
    total = tl.sum(tl.zeros([SB], tl.float32), 0)
    acc = tl.zeros([DB], tl.float32)
    for s0 in range(0, S, SB):
        s = s0 + tl.arange(0, SB)
        lse = tl.load(lse_base + s * s_ls, mask=s < S, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(lse - m_safe)  # 0 for empty partials
        o = tl.load(OUT_P + b * s_ob + h * s_oh + s[:, None] * s_os + g * s_og + d[None, :],
                    mask=(w > 0)[:, None] & (d < D)[None, :], other=0.0)
        alpha = tl.exp(m - m_safe)
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(OUT + b * s_yb + (ho * G + g) * s_yh + d, out, mask=d < D)
    if part == 0:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        tl.store(LSE + pid, tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf")))


def _output(out: torch.Tensor | None, b: int, hq: int, d: int, device: torch.device,
            dtype: torch.dtype, groups_of: int | None = None) -> torch.Tensor:
    """The call's output: ``out`` when given (a ``[B, Hq, D]`` view with a unit last stride; with ``out_heads``,
    ``[B, H · groups_of, D]`` for any H), else a new tensor."""
    if out is None:
        return torch.empty(b, hq, d, device=device, dtype=dtype)
    heads_ok = out.shape[1] == hq if groups_of is None else out.shape[1] % groups_of == 0
    if out.shape[0] != b or out.shape[2] != d or not heads_ok or out.stride(-1) != 1:
        want = hq if groups_of is None else f"H · {groups_of}"
        raise ValueError(f"out must be [{b}, {want}, {d}] with a unit last stride, got {list(out.shape)} "
                         f"strides {out.stride()}")
    return out


def combine_partials(out_p: torch.Tensor, lse_p: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                     parts: int | None = None, out: torch.Tensor | None = None,
                     out_heads: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split-K partials ``[B, Hkv, S, G, D]`` / ``[B, Hkv, S, G]`` into ``[B, Hq, D]`` (``out_dtype``, or
    written into ``out``, a view with unit last stride; KV head h's group at ``out_heads[h]`` when given, as in
    :func:`sparse_decode_attention`) / ``[B, Hq]`` (float32, in the partials' order). ``parts``: programs per
    head, each merging a slice of D (default: by the GPU's size)."""
    b, hkv, splits, g, d = out_p.shape
    out = _output(out, b, hkv * g, d, out_p.device, out_dtype, g if out_heads is not None else None)
    lse = torch.empty(b, hkv * g, device=out_p.device, dtype=torch.float32)
    sb = min(128, max(16, triton.next_power_of_2(splits)))  # every partial in one block up to 128 of them
    d_pad = triton.next_power_of_2(d)
    # Few heads (batch 1): split D too, so the merge spreads over more of the GPU than one program per head
    if parts is None:
        parts = max(1, min(4, d_pad // 32, 2 * sm_count(out_p) // max(1, b * hkv * g)))
    parts = 1 << (min(parts, d_pad).bit_length() - 1)  # a power of two that divides d_pad
    db = d_pad // parts
    _combine[(b * hkv * g, parts)](out_p, lse_p, out, out_heads if out_heads is not None else lse, lse,
                                   out_p.stride(0), out_p.stride(1), out_p.stride(2),
                                   out_p.stride(3), lse_p.stride(0), lse_p.stride(1), lse_p.stride(2), out.stride(0),
                                   out.stride(1), hkv, g, splits,
                                   SB=sb, D=d, DB=db, HAS_OHEADS=out_heads is not None,
                                   num_warps=4 if sb * db <= 4096 else 8,
                                   **pdl.options(out_p.device))
    return out, lse
