"""Triton top-k with a recency window: one program per row, the k-th largest score found by a radix select.

Same choice as :func:`runtime.kernels.topk_select.naive.topk_with_recent` (ties among equal scores go to the
lower id), returned as ascending ids, -1 padded at the end. The scores map to 32-bit integers that order as
the floats do; four byte histograms fix the k-th largest one byte at a time, then one prefix sum places
every chosen id. Rows run in parallel, so the time does not grow with the batch (``torch.topk`` takes
one pass per radix digit over every row); a row must fit one program (:data:`MAX_N` scores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_N = 16384  # scores per row one program holds in registers


@triton.jit
def _topk_recent(S, LAST, OUT, s_row, s_last, n, W: tl.constexpr, W_PAD: tl.constexpr, RECENT: tl.constexpr,
                 N_PAD: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, N_PAD)
    last = tl.load(LAST + row * s_last)
    ok = (i < n) & (i <= last)
    x = tl.load(S + row * s_row + i, mask=ok, other=float("-inf")).to(tl.float32)
    x = tl.where(ok & (i > last - RECENT), float("inf"), x)
    x = tl.where(ok, x, float("-inf"))
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648  # float order, in [0, 2^32)
    # The W-th largest key, one byte at a time from the top: a histogram of the next byte among the keys that
    # share the bytes fixed so far, and the largest byte value with enough keys at or above it.
    bins = tl.arange(0, 512)
    prefix = tl.sum(tl.zeros([1], tl.int64), 0)
    need = tl.sum(tl.zeros([1], tl.int32), 0) + W
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        same = (key >> (shift + 8)) == (prefix >> (shift + 8))
        byte = tl.where(same, (key >> shift) & 255, 256).to(tl.int32)  # 256: not a candidate any more
        hist = tl.where(bins < 256, tl.histogram(byte, 512), 0)
        at_least = tl.cumsum(hist, 0, reverse=True)
        chosen_byte = tl.max(tl.where(at_least >= need, bins, -1), 0)
        need -= tl.sum(tl.where(bins > chosen_byte, hist, 0), 0)
        prefix = prefix | (chosen_byte.to(tl.int64) << shift)
    kth = prefix
    live = x > float("-inf")
    greater = live & (key > kth)
    equal = live & (key == kth)
    take = W - tl.sum(greater.to(tl.int32), 0)
    chosen = greater | (equal & (tl.cumsum(equal.to(tl.int32), 0) <= take))
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(OUT + row * W + slot, i, mask=chosen)
    j = tl.arange(0, W_PAD)
    tl.store(OUT + row * W + j, tl.full([W_PAD], -1, tl.int32), mask=(j < W) & (j >= tl.sum(chosen.to(tl.int32), 0)))


def topk_with_recent(scores: torch.Tensor, k: int, recent: int, last: torch.Tensor | int | None = None) -> torch.Tensor:
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
                                       N_PAD=triton.next_power_of_2(n), num_warps=8 if n > 2048 else 4)
    return out.view(*lead, w)
