"""Triton top-k with a recency window: one program per row, the k-th largest score found by a radix search.

Same choice as :func:`runtime.kernels.topk_select.naive.topk_with_recent` (ties among equal scores go to the
lower id), returned as ascending ids, -1 padded at the end. The scores map to unsigned 32-bit integers that order
as the floats do; 16 rounds of "how many are at least each of these four" fix the k-th largest two bits at a time
(``bits``; from 8 bits a round, a masked histogram of the next digit among the keys that share the prefix so
far, 4 rounds), then one prefix sum places every chosen id. Rows run in parallel, so the time does not grow with
the batch (``torch.topk`` takes one pass per radix digit over every row); a row must fit one program
(:data:`MAX_N` scores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_N = 16384  # scores per row one program holds in registers


@triton.jit
def top_w(x, W: tl.constexpr, BITS: tl.constexpr):
    """``[N_PAD]`` float32 ranks (``+inf``: always taken, ``-inf``: never) → a mask of the ``W`` largest (ties to
    the lower index; fewer where fewer are above ``-inf``). Shared with the kernels that choose inside a larger
    program (:func:`runtime.kernels.page_bounds.triton.refine_candidates`)."""
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
def _topk_recent(S, LAST, OUT, s_row, s_last, n, W: tl.constexpr, W_PAD: tl.constexpr, RECENT: tl.constexpr,
                 N_PAD: tl.constexpr, BITS: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, N_PAD)
    last = tl.load(LAST + row * s_last)
    ok = (i < n) & (i <= last)
    x = tl.load(S + row * s_row + i, mask=ok, other=float("-inf")).to(tl.float32)
    x = tl.where(ok & (i > last - RECENT), float("inf"), x)
    x = tl.where(ok, x, float("-inf"))
    store_ascending(OUT + row * W, i, top_w(x, W, BITS), W, W_PAD)


def _warps(n: int) -> int:
    """Measured on an H200 (rows of 8192 / 2048 scores, two bits a round): 16 warps 30 µs vs 38 at 8; 8 warps
    11.9 vs 13.4 at 16 (one bit a round: 33 and 14.4 µs; four: 16.1 µs at 2048). By histogram, 8 bits a round
    (``benchmarks/kernels.py --topk``, ``kernels_topk_h200.json``): 27.5 µs against 26.3 for 9 rows of 8192 at
    16 warps, 10.8 against 11.3 for 64 rows of 2048 at 8 warps, so two bits a round stays the default."""
    return 16 if n > 4096 else 8 if n > 512 else 4


def topk_with_recent(scores: torch.Tensor, k: int, recent: int, last: torch.Tensor | int | None = None,
                     num_warps: int | None = None, bits: int = 2) -> torch.Tensor:
    """``[..., n]`` scores → ``[..., min(k, n)]`` int32 ascending ids, -1 padded (see the module docstring)."""
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
    out = torch.empty(rows.shape[0], w, device=scores.device, dtype=torch.int32)
    if rows.shape[0]:
        _topk_recent[(rows.shape[0],)](rows, last, out, rows.stride(0), last.stride(0) if last.dim() else 0, n, W=w,
                                       W_PAD=triton.next_power_of_2(w), RECENT=recent,
                                       N_PAD=triton.next_power_of_2(n), BITS=bits,
                                       num_warps=num_warps or _warps(n))
    return out.view(*lead, w)
