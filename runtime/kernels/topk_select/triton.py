"""Triton top-k with a recency window: the k-th largest score of a row found by a radix search.

Same choice as :func:`rolecall.runtime.kernels.topk_select.naive.topk_with_recent` (ties among equal scores go to the
lower id), returned as ascending ids, -1 padded at the end. The scores map to unsigned 32-bit integers that order
as the floats do; 16 rounds of "how many are at least each of these four" fix the k-th largest two bits at a time
(``bits``; from 8 bits a round, a masked histogram of the next digit among the keys that share the prefix so
far, 4 rounds), then one prefix sum places every chosen id. Rows run in parallel, so the time does not grow with
the batch (``torch.topk`` takes one pass per radix digit over every row); a row must fit one program
(:data:`MAX_N` scores). When there are too few rows to fill the GPU, each row is split over several programs
that keep their part's k largest, and the last of them to finish chooses among those
(:mod:`rolecall.runtime.kernels.arrivals`): two searches over short rows instead of one over a long row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rolecall.runtime.kernels import pdl, sm_count
from rolecall.runtime.kernels.arrivals import arrival_counters

MAX_N = 16384  # scores per row one program holds in registers


@triton.jit
def top_w(x, W: tl.constexpr, BITS: tl.constexpr):
    """``[N_PAD]`` float32 ranks (``+inf``: always taken, ``-inf``: never) → a mask of the ``W`` largest (ties to
    the lower index; fewer where fewer are above ``-inf``). Shared with the kernels that choose inside a larger
    program (:func:`rolecall.runtime.kernels.page_bounds.triton.refine_candidates`)."""
    bits = x.to(tl.int32, bitcast=True)
    # unsigned 32-bit keys in float order (negative floats: every bit flipped; the others: the sign bit set)
    key = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
    # the W-th largest key is the largest t with at least W live keys >= t, fixed BITS bits per round from the top
    live = x > float("-inf")
    kth = tl.sum(tl.zeros([1], tl.uint32), 0)
    if BITS >= 8:  # a histogram of the next digit among the keys that share kth's prefix, one pass a round
        above = tl.sum(tl.zeros([1], tl.int32), 0)  # live keys past kth's prefix so far
        bin_id = tl.arange(0, 1 << BITS)
        for r in tl.static_range(0, 32 // BITS):
            shift = 32 - (r + 1) * BITS
            if r == 0:
                match = live
            else:
                match = live & ((key >> (shift + BITS)) == (kth >> (shift + BITS)))
            d = ((key >> shift) & ((1 << BITS) - 1)).to(tl.int32)
            h = tl.histogram(d, 1 << BITS, mask=match)
            at_least = above + tl.cumsum(h, 0, reverse=True)  # live keys >= prefix·digit, per digit
            best = tl.max(tl.where(at_least >= W, bin_id, 0), 0)
            above += tl.sum(tl.where(bin_id > best, h, 0), 0)
            kth += best.to(tl.uint32) << shift
    else:  # count the keys at or above each of the 2^BITS candidates in one reduction
        digit = tl.arange(0, 1 << BITS).to(tl.uint32)
        for r in tl.static_range(0, 32 // BITS):
            shift = 32 - (r + 1) * BITS
            count = tl.sum((key[None, :] >= (kth + (digit << shift))[:, None]).to(tl.int32), 1)  # [2^BITS]
            kth += tl.max(tl.where(count >= W, digit, 0), 0) << shift
    greater = live & (key > kth)
    equal = live & (key == kth)
    take = W - tl.sum(greater.to(tl.int32), 0)
    return greater | (equal & (tl.cumsum(equal.to(tl.int32), 0) <= take))


@triton.jit
def store_ascending(OUT, values, chosen, W: tl.constexpr, W_PAD: tl.constexpr):
    """Write ``values`` where ``chosen`` to ``OUT[0:W]`` in their order, then -1 up to ``W``."""
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(OUT + slot, values, mask=chosen)
    j = tl.arange(0, W_PAD)
    tl.store(OUT + j, tl.full([W_PAD], -1, tl.int32), mask=(j < W) & (j >= tl.sum(chosen.to(tl.int32), 0)))


@triton.jit
def _ranks(S, LAST, row, s_row, s_last, i, n, RECENT: tl.constexpr):
    """Row ``row``'s scores at ids ``i`` as ranks: ``+inf`` for the ``RECENT`` ids up to its last, ``-inf`` past the
    last or the row's end."""
    last = tl.load(LAST + row * s_last)
    ok = (i < n) & (i <= last)
    x = tl.load(S + row * s_row + i, mask=ok, other=float("-inf")).to(tl.float32)
    x = tl.where(ok & (i > last - RECENT), float("inf"), x)
    return tl.where(ok, x, float("-inf"))


@triton.jit
def _out_row(OUT, OUT_ROWS, row, W: tl.constexpr, HAS_ROWS: tl.constexpr):
    """Where row ``row``'s ids go: its own row of OUT, or the row OUT_ROWS names."""
    if HAS_ROWS:
        return OUT + tl.load(OUT_ROWS + row) * W
    return OUT + row * W


@triton.jit
def _topk_recent(S, LAST, OUT, OUT_ROWS, s_row, s_last, n, W: tl.constexpr, W_PAD: tl.constexpr,
                 RECENT: tl.constexpr, N_PAD: tl.constexpr, BITS: tl.constexpr, HAS_ROWS: tl.constexpr,
                 PDL: tl.constexpr = False):
    pdl.wait(PDL)
    row = tl.program_id(0)
    i = tl.arange(0, N_PAD)
    store_ascending(_out_row(OUT, OUT_ROWS, row, W, HAS_ROWS), i,
                    top_w(_ranks(S, LAST, row, s_row, s_last, i, n, RECENT), W, BITS), W, W_PAD)


@triton.jit
def _topk_recent_parts(S, LAST, CAND_S, CAND_I, ARRIVED, OUT, OUT_ROWS, s_row, s_last, n, W: tl.constexpr,
                       W_PAD: tl.constexpr, RECENT: tl.constexpr, SPAN: tl.constexpr, PARTS: tl.constexpr,
                       BITS: tl.constexpr, HAS_ROWS: tl.constexpr, PDL: tl.constexpr = False):
    """A row split over PARTS programs: each keeps the W largest of its SPAN scores (in id order) in a scratch row;
    the last to arrive chooses among the PARTS·W_PAD kept ones, which are in id order too, so ties still go to
    the lower id and the ids come out ascending."""
    pdl.wait(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    i = part * SPAN + tl.arange(0, SPAN)
    x = _ranks(S, LAST, row, s_row, s_last, i, n, RECENT)
    kept = top_w(x, W, BITS)
    base = (row * PARTS + part) * W_PAD
    slot = tl.cumsum(kept.to(tl.int32), 0) - 1
    tl.store(CAND_S + base + slot, x, mask=kept)
    tl.store(CAND_I + base + slot, i, mask=kept)
    j = tl.arange(0, W_PAD)
    tl.store(CAND_S + base + j, tl.full([W_PAD], float("-inf"), tl.float32),
             mask=j >= tl.sum(kept.to(tl.int32), 0))
    tl.debug_barrier()  # every thread's candidates stored before the arrival is counted (released by the atomic)
    if tl.atomic_add(ARRIVED + row, 1, sem="acq_rel") == PARTS - 1:
        tl.store(ARRIVED + row, 0)  # every part has arrived: the counter is ready for the next launch
        c = row * PARTS * W_PAD + tl.arange(0, PARTS * W_PAD)
        xs = tl.load(CAND_S + c, cache_modifier=".cg")  # the other parts' candidates, from L2
        ids = tl.load(CAND_I + c, cache_modifier=".cg")
        store_ascending(_out_row(OUT, OUT_ROWS, row, W, HAS_ROWS), ids, top_w(xs, W, BITS), W, W_PAD)


def split_parts(rows: int, n: int, w: int, sms: int) -> tuple[int, int]:
    """``(parts, span)``: programs per row and scores per program. Few rows leave most of the GPU idle while one
    program per row searches its whole row, so a row is split in parts of about ``√(n · w)`` scores (the two
    stages then hold rows of similar size), as long as each part keeps at most a quarter of what it reads and
    the rows' parts still fit the GPU; ``(1, n)`` where that does not pay. H200, ``benchmarks/kernels.py --topk``
    (``kernels_topk_split_h200.json``): 8 rows of 8,192, k = 128, 17.3 µs in 8 parts against 26.7 in one program
    a row; k = 512, 22.3 in 4 parts against 26.8; rows of 2,048 were faster in one program (11.4 against 14.6)."""
    w_pad = triton.next_power_of_2(w)
    span = max(4 * w_pad, triton.next_power_of_2(int(math.sqrt(n * w_pad))))
    parts = min(triton.cdiv(n, span), max(1, sms // max(rows, 1)), MAX_N // w_pad)
    parts = 1 << (max(parts, 1).bit_length() - 1)  # a power of two: the final row is PARTS · W_PAD
    if parts < 2 or n <= 4096:  # rows that one program of 8 warps holds: its one search was faster
        return 1, n
    return parts, triton.next_power_of_2(triton.cdiv(n, parts))


def _warps(n: int) -> int:
    """Measured on an H200 (rows of 8192 / 2048 scores, two bits a round): 16 warps 30 µs vs 38 at 8; 8 warps
    11.9 vs 13.4 at 16 (one bit a round: 33 and 14.4 µs; four: 16.1 µs at 2048). By histogram, 8 bits a round
    (``benchmarks/kernels.py --topk``, ``kernels_topk_h200.json``): 27.5 µs against 26.3 for 9 rows of 8192 at
    16 warps, 10.8 against 11.3 for 64 rows of 2048 at 8 warps, so two bits a round stays the default."""
    return 16 if n > 4096 else 8 if n > 512 else 4


def topk_with_recent(scores: torch.Tensor, k: int, recent: int, last: torch.Tensor | int | None = None,
                     num_warps: int | None = None, bits: int = 2, parts: int | None = None,
                     out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., n]`` scores → ``[..., min(k, n)]`` int32 ascending ids, -1 padded (see the module docstring).

    ``parts``: programs per row (default :func:`split_parts`, by the GPU's size; 1 = one program per row).
    ``out`` (contiguous int32 ``[..., min(k, n)]`` of any leading shape) with ``out_rows`` (int32, one per row of
    ``scores``): row i's ids go to row ``out_rows[i]`` of ``out`` flattened to rows, in place; ``out`` is
    returned. A set kept in another row order (LycheeDecode's, by original head) takes its new rows there
    without a copy."""
    n = scores.shape[-1]
    if n > MAX_N:
        raise ValueError(f"{n} scores per row exceed the {MAX_N} one program holds; use the reference")
    lead = scores.shape[:-1]
    rows = scores.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if last is None:
        last = n - 1
    last = torch.as_tensor(last, device=scores.device).to(torch.int64)
    last = last.expand(lead).reshape(-1) if last.dim() else last  # one for all rows: read with stride 0
    w = min(k, n)
    w_pad = triton.next_power_of_2(w)
    r = rows.shape[0]
    if (out is None) != (out_rows is None):
        raise ValueError("out and out_rows go together")
    if out is not None:
        if (out.dtype != torch.int32 or not out.is_contiguous() or out.shape[-1] != w or out_rows.dtype != torch.int32
                or out_rows.shape != (r,) or out_rows.stride(0) != 1):
            raise ValueError(f"out must be contiguous int32 [..., {w}] and out_rows contiguous int32 [{r}], got {out.dtype} "
                             f"{list(out.shape)} and {out_rows.dtype} {list(out_rows.shape)}")
        result, dest = out, out
    else:
        dest = torch.empty(r, w, device=scores.device, dtype=torch.int32)
        result = dest.view(*lead, w)
    if not r:
        return result
    if parts is None:
        parts, span = split_parts(r, n, w, sm_count(scores))
    else:
        parts = 1 << (max(1, min(parts, MAX_N // w_pad)).bit_length() - 1)
        span = triton.next_power_of_2(triton.cdiv(n, parts))
    s_last = last.stride(0) if last.dim() else 0
    if parts == 1:
        _topk_recent[(r,)](rows, last, dest, out_rows if out_rows is not None else dest, rows.stride(0), s_last, n,
                           W=w, W_PAD=w_pad, RECENT=recent, N_PAD=triton.next_power_of_2(n), BITS=bits,
                           HAS_ROWS=out_rows is not None, num_warps=num_warps or _warps(n),
                           **pdl.options(scores.device))
        return result
    cand_s = torch.empty(r, parts * w_pad, device=scores.device, dtype=torch.float32)
    cand_i = torch.empty(r, parts * w_pad, device=scores.device, dtype=torch.int32)
    _topk_recent_parts[(r, parts)](rows, last, cand_s, cand_i, arrival_counters(scores.device, r), dest,
                                   out_rows if out_rows is not None else dest, rows.stride(0), s_last, n, W=w,
                                   W_PAD=w_pad, RECENT=recent, SPAN=span, PARTS=parts, BITS=bits,
                                   HAS_ROWS=out_rows is not None,
                                   num_warps=num_warps or _warps(max(span, parts * w_pad)),
                                   **pdl.options(scores.device))
    return result
