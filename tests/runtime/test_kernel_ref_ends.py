"""The PyTorch reference kernels at their exact ends, worked by hand: pages when the length divides by the page
size and one token past it, the recent window's first entry, a chosen set wider than what exists, a block that
runs past the sequence, a page whose first or last slot is the one recomputed, an empty set."""

from __future__ import annotations

import math

import pytest
import torch

from rolecall.runtime.kernels.page_bounds.naive import (
    page_bounds,
    page_minmax,
    refine_candidates,
    update_page,
)
from rolecall.runtime.kernels.page_scores.naive import pool_pages
from rolecall.runtime.kernels.sparse_attention.naive import (
    expand_blocks,
    indices_to_mask,
    sparse_decode_attention,
)
from rolecall.runtime.kernels.topk_select.naive import (
    mask_to_indices,
    topk_mask_with_recent,
    topk_with_recent,
)

INF = math.inf


# -- page sums -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scores, page, sums", [
    ([1, 2, 3, 4], 2, [3, 7]),  # T divides by P: no partial page
    ([1, 2, 3, 4, 5], 2, [3, 7, 5]),  # one past: a last page of one token
    ([1, 2, 3, 4], 4, [10]),  # one page exactly
    ([1, 2, 3, 4], 5, [10]),  # a page longer than the sequence
    ([7], 3, [7]),  # one token
    ([1, 2, 3], 1, [1, 2, 3]),  # pages of one token are the tokens
])
def test_pool_pages_sums_whole_pages_and_a_partial_last(scores, page, sums):
    assert pool_pages(torch.tensor([scores], dtype=torch.float32), page).tolist() == [sums]


# -- top-k with a recent window ------------------------------------------------------------------------------------------
SCORES = [5.0, 1.0, 4.0, 2.0, 3.0]


@pytest.mark.parametrize("k, recent, extra, chosen", [
    (2, 1, {}, [0, 4]),  # the last entry, then the best other: the window is exactly `recent` wide
    (3, 2, {}, [0, 3, 4]),
    (2, 0, {}, [0, 2]),  # no window: the top two
    (2, 2, {}, [3, 4]),  # the window fills k: the recent ones win over higher scores
    (1, 1, {}, [4]),
    (7, 1, {}, [0, 1, 2, 3, 4]),  # k past n: width n, everything
    (3, 1, {"last": 2}, [0, 1, 2]),  # entries after `last` never chosen; the window ends at `last`
    (4, 1, {"last": 2}, [0, 1, 2, -1]),  # fewer than k exist: -1 padded at the end
    (5, 0, {"valid": [True, False, True, True, True]}, [0, 2, 3, 4, -1]),  # an invalid entry is never chosen
    # an invalid entry in the window is not chosen, and the window does not move back: the top two of the rest
    (2, 1, {"valid": [True, True, True, True, False]}, [0, 2]),
])
def test_topk_with_recent_at_the_windows_ends(k, recent, extra, chosen):
    kw = {}
    if "last" in extra:
        kw["last"] = extra["last"]
    if "valid" in extra:
        kw["valid"] = torch.tensor([extra["valid"]])
    got = topk_with_recent(torch.tensor([SCORES]), k, recent, **kw)
    assert got.tolist() == [chosen]
    mask = topk_mask_with_recent(torch.tensor([SCORES]), k, recent, **kw)
    assert mask.tolist() == [[i in chosen for i in range(len(SCORES))]]


@pytest.mark.parametrize("recent, chosen", [
    # positions [7, 2, 5] (a Δ-layer's candidate pages): `last` defaults to the largest, 7; the window holds the
    # positions p > 7 - recent
    (1, [2, 7]),  # 7 recent, then the best score: position 2
    (2, [2, 7]),  # 5 > 7 - 2 is false: 5 is still outside the window
    (3, [5, 7]),  # 5 > 4: the window's first position
])
def test_topk_with_recent_counts_the_window_in_positions(recent, chosen):
    got = topk_with_recent(torch.tensor([[1.0, 3.0, 2.0]]), 2, recent, positions=torch.tensor([[7, 2, 5]]))
    assert got.tolist() == [chosen]


@pytest.mark.parametrize("width, ids", [
    (None, [[0, 2], [-1, -1]]),  # the largest count in the batch
    (3, [[0, 2, -1], [-1, -1, -1]]),
    (1, [[0], [-1]]),  # narrower than a row's count: its first ids
])
def test_mask_to_indices_width(width, ids):
    mask = torch.tensor([[True, False, True], [False, False, False]])
    assert mask_to_indices(mask, width).tolist() == ids


# -- blocks to tokens ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("indices, block, length, tokens", [
    ([0, 2, -1], 2, 5, [0, 1, 4, -1, -1, -1]),  # block 2 holds 4 and 5; 5 is past a length of 5
    ([0, 2, -1], 2, 6, [0, 1, 4, 5, -1, -1]),  # a length that ends on the block's end: both
    ([1], 3, 4, [3, -1, -1]),  # a last block of one token
    ([0, 4, 5], 1, 5, [0, 4, -1]),  # block size 1: the last token is length - 1
])
def test_expand_blocks_stops_at_the_length(indices, block, length, tokens):
    assert expand_blocks(torch.tensor([indices]), block, length).tolist() == [tokens]


@pytest.mark.parametrize("indices, block, length, mask", [
    ([1, -1], 2, 3, [False, False, True]),  # a partial last block reads only its one token
    ([0, 1], 2, 4, [True, True, True, True]),
    ([-1], 2, 2, [False, False]),  # padding reads nothing
])
def test_indices_to_mask(indices, block, length, mask):
    assert indices_to_mask(torch.tensor([[indices]]), block, length).tolist() == [[mask]]


def test_indices_to_mask_without_indices_reads_every_token():
    assert indices_to_mask(None, 4, 3, shape=(1, 2)).tolist() == [[[True] * 3] * 2]


# -- sparse attention over a listed set ----------------------------------------------------------------------------------
def _one_head(keys, values):
    k = torch.tensor(keys, dtype=torch.float32).view(1, 1, -1, 1)
    v = torch.tensor(values, dtype=torch.float32).view(1, 1, -1, 1)
    return torch.ones(1, 1, 1), k, v


@pytest.mark.parametrize("indices, block, log_weights, out, lse", [
    # logits 0 and log 3 over values 1 and 5: (1·1 + 3·5) / 4 = 4, lse = log 4
    ([0, 1], 1, None, 4.0, math.log(4)),
    # weight 1/3 on the second: both weigh 1, (1 + 5) / 2 = 3, lse = log 2
    ([0, 1], 1, [0.0, math.log(1 / 3)], 3.0, math.log(2)),
    # block 1 of size 2 holds tokens 2 and 3; token 3 is past the three keys: token 2 alone (value 7)
    ([1], 2, None, 7.0, 0.0),
    # an empty set: output 0, lse -inf
    ([-1], 1, None, 0.0, -INF),
])
def test_sparse_decode_attention_over_a_set_by_hand(indices, block, log_weights, out, lse):
    q, k, v = _one_head([0.0, math.log(3), 0.0], [1.0, 5.0, 7.0])
    lw = None if log_weights is None else torch.tensor([[log_weights]])
    got, got_lse = sparse_decode_attention(q, k, v, torch.tensor([[indices]]), scale=1.0, block_size=block,
                                           log_weights=lw)
    assert float(got[0, 0, 0]) == pytest.approx(out, abs=1e-6)
    assert float(got_lse[0, 0]) == pytest.approx(lse, abs=1e-6) if lse != -INF else float(got_lse[0, 0]) == -INF


# -- page bounds ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keys, keep, page, kmin, kmax", [
    ([1, 5, 3], [1, 1, 1], 2, [1, 3], [5, 3]),  # a last page of one slot
    ([1, 5, 3, 2], [1, 1, 1, 1], 2, [1, 2], [5, 3]),  # T divides by P
    ([1, 5, 3, 2], [0, 1, 1, 1], 2, [5, 2], [5, 3]),  # a padded slot is left out
    ([1, 5, 3, 2], [0, 0, 1, 1], 2, [INF, 2], [-INF, 3]),  # a page with no readable slot is empty
    ([4], [1], 3, [4], [4]),
])
def test_page_minmax_by_hand(keys, keep, page, kmin, kmax):
    k = torch.tensor(keys, dtype=torch.float32).view(1, 1, -1, 1)
    lo, hi = page_minmax(k, torch.tensor([keep], dtype=torch.bool), page)
    assert lo.flatten().tolist() == kmin and hi.flatten().tolist() == kmax


@pytest.mark.parametrize("q, kmin, kmax, bound", [
    # max(1·-1, 1·2) + max(-2·0, -2·3) = 2 + 0, times the scale 0.5
    ([1.0, -2.0], [-1.0, 0.0], [2.0, 3.0], 1.0),
    # max(-1·-4, -1·-2) + max(3·1, 3·2) = 4 + 6
    ([-1.0, 3.0], [-4.0, 1.0], [-2.0, 2.0], 5.0),
    ([0.0, 0.0], [-4.0, 1.0], [-2.0, 2.0], 0.0),
    ([1.0, 1.0], [2.0, 3.0], [2.0, 3.0], 2.5),  # a page of one key (kmin = kmax) is not empty
    ([1.0, 1.0], [INF, INF], [-INF, -INF], -INF),  # an empty page
])
def test_page_bounds_take_each_dimensions_larger_product(q, kmin, kmax, bound):
    got = page_bounds(torch.tensor([[q]]), torch.tensor([[[kmin]]]), torch.tensor([[[kmax]]]), 0.5)
    assert float(got[0, 0, 0]) == bound


@pytest.mark.parametrize("first, last, lo, hi, page", [
    (0, 3, 30, 40, 1),  # slot 3 is the page's last: the page holds slots 2 and 3
    (0, 2, 30, 30, 1),  # slot 2 is its first: slot 3, after `last`, is left out
    (3, 3, 40, 40, 1),  # slot 2 is before `first`
    (0, 4, 50, 50, 2),  # the cache ends inside the page: slot 5 does not exist
    (0, 1, 10, 20, 0),
])
def test_update_page_recomputes_the_page_of_last(first, last, lo, hi, page):
    key = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0]).view(1, 1, 5, 1)
    kmin = torch.full((1, 1, 3, 1), -7.0)
    kmax = torch.full((1, 1, 3, 1), -7.0)
    update_page(key, kmin, kmax, torch.tensor([first]), torch.tensor(last), 2)
    assert float(kmin[0, 0, page, 0]) == lo and float(kmax[0, 0, page, 0]) == hi
    others = [p for p in range(3) if p != page]
    assert kmin[0, 0, others, 0].tolist() == [-7.0, -7.0]  # no other page touched


def test_update_page_takes_each_rows_own_last_slot():
    key = torch.tensor([[10.0, 20.0, 30.0, 40.0, 50.0], [1.0, 2.0, 3.0, 4.0, 5.0]]).view(2, 1, 5, 1)
    kmin = torch.full((2, 1, 3, 1), -7.0)
    kmax = torch.full((2, 1, 3, 1), -7.0)
    update_page(key, kmin, kmax, torch.tensor([0, 1]), torch.tensor([4, 1]), 2)  # row 0: page 2; row 1: page 0
    assert kmin[:, 0, :, 0].tolist() == [[-7.0, -7.0, 50.0], [2.0, -7.0, -7.0]]
    assert kmax[:, 0, :, 0].tolist() == [[-7.0, -7.0, 50.0], [2.0, -7.0, -7.0]]


@pytest.mark.parametrize("candidates, num_pages, recent, chosen", [
    # page bounds (one head, q = 1, scale 1) are the pages' keys: page u scores 4 - u
    ([0, 1, 2, 3], 2, 1, [0, 3]),  # the largest candidate is recent; then the best
    ([0, 1, 2, 3], 2, 2, [2, 3]),  # within 2 of the largest: 2 and 3
    ([3, 0, -1], 2, 1, [0, 3]),  # any order, -1 never chosen
    ([3, 0, -1], 3, 1, [0, 3, -1]),  # fewer than asked: -1 padded
    ([1, 3], 2, 2, [1, 3]),  # 1 is not within 2 of 3 but fills the rest
])
def test_refine_candidates_keeps_the_recent_pages_of_the_largest_candidate(candidates, num_pages, recent, chosen):
    keys = torch.tensor([4.0, 3.0, 2.0, 1.0]).view(1, 1, 4, 1)
    got = refine_candidates(torch.ones(1, 1, 1), keys, keys, torch.tensor([[candidates]]), 1.0, num_pages, recent)
    assert got.tolist() == [[chosen]]
