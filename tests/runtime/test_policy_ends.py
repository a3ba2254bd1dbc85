"""The policies' sizes at their exact ends, worked by hand: tokens read per layer when the context is shorter
than a window or a budget, block counts when the recent tokens outnumber the budget, shares at a threshold;
pages chosen when the context divides by the page size and one token past it, a GQA group's max against its sum,
lethe's capacities at a rounding tie and its breakpoint where the running mass equals τ exactly, vAttention's
sinks, window and heavy hitters at their first and last slot and its residual read whole at the pilot's size."""

from __future__ import annotations

import math
import re
from statistics import NormalDist
from types import SimpleNamespace

import pytest
import torch

from rolecall.runtime.policies import mean_tokens_read


@pytest.mark.parametrize("windows, context, budget, full, reads", [
    # a window longer than the context reads the context: (10 + 10 + 10) / 3
    ([None, None, 16], 10, 16, [1.0, 0.0, 0.0], (10 + 10 + 10) / 3),
    # a window exactly the context reads it; one shorter reads the window
    ([None, 10, 4], 10, 16, [1.0, 0.0, 0.0], (10 + 10 + 4) / 3),
    # a budget above the context reads the context, one below reads the budget, a half-full layer both
    ([None, None], 10, 16, [0.0, 0.5], (10 + 10) / 2),
    ([None, None], 10, 6, [0.0, 0.5], (6 + 0.5 * 10 + 0.5 * 6) / 2),
    # every layer windowed (Mistral) at a context below the window: the context
    ([8, 8, 8, 8], 5, 2, [0.0, 0.0, 0.0, 0.0], 5.0),
    ([8, 8, 8, 8], 9, 2, [0.0, 0.0, 0.0, 0.0], 8.0),
])
def test_tokens_read_never_exceed_the_context(windows, context, budget, full, reads):
    """A layer reads min(context, window) with a window, else ``f · context + (1 − f) · min(context, budget)``."""
    assert mean_tokens_read(SimpleNamespace(windows=windows), context, budget, full) == pytest.approx(reads)


def _step(layer, query, keys, scratch=None, scale=1.0):
    """A Step of one row: ``query [Hq][D]``, ``keys [Hkv][T][D]``, every slot readable."""
    from rolecall.runtime.policies import Step

    q = torch.tensor([query], dtype=torch.float32)
    k = torch.tensor([keys], dtype=torch.float32)
    return Step(layer, q, k, k.clone(), torch.ones(1, k.shape[2], dtype=torch.bool), scale,
                {} if scratch is None else scratch)


# -- delta -----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scores, k, recent, pages", [
    ([5, 5, 1, 1, 3, 3], 2, 1, [0, 2]),  # T = 3P: page sums 10, 2, 6; the last page, then the best
    ([5, 5, 1, 1, 3], 2, 1, [0, 2]),  # one token past 2P: the partial last page (3) is the recent one
    ([5, 5, 1, 1, 3], 2, 2, [1, 2]),  # L = K: only recent pages
    ([5, 5, 1, 1, 3], 3, 1, [0, 1, 2]),  # K = the pages there are
    ([5, 5, 1, 1, 3], 4, 1, [0, 1, 2]),  # K past them: width ceil(T / P)
    ([1, 1, 9, 0], 1, 0, [1]),  # L = 0: the best page alone
    ([7], 1, 1, [0]),
])
def test_delta_select_pages(scores, k, recent, pages):
    from rolecall.runtime.policies.delta import select_pages

    assert select_pages(torch.tensor([scores], dtype=torch.float32), 2, k, recent).tolist() == [pages]


def test_delta_select_pages_refuses_more_recent_pages_than_pages():
    from rolecall.runtime.policies import PolicyError
    from rolecall.runtime.policies.delta import select_pages

    assert select_pages(torch.ones(1, 4), 2, 2, 2).tolist() == [[0, 1]]
    with pytest.raises(PolicyError, match="recent_pages must be an integer in"):
        select_pages(torch.ones(1, 4), 2, 2, 3)


@pytest.mark.parametrize("tokens, pages", [(6, [0, 2]), (7, [0, 3]), (8, [0, 3]), (9, [0, 4]), (2, [0])])
def test_delta_sparse_layer_reads_the_pages_its_delta_layer_chose(tokens, pages):
    """Token 1 takes nearly all the attention: pages of 2, K = 2, L = 1 give page 0 and the last page, which is
    partial one token past a multiple of the page size."""
    from rolecall.runtime.policies import get_policy

    d = get_policy("delta", num_pages=2, recent_pages=1, page_size=2)
    d.roles = [1, 2]
    keys = [[[10.0 if t == 1 else 0.0] for t in range(tokens)]]
    scratch: dict = {}
    assert d.plan(_step(0, [[1.0]], keys, scratch)).indices is None  # a Δ-layer reads everything
    plan = d.plan(_step(1, [[1.0]], keys, scratch))
    assert plan.indices.tolist() == [[pages]] and plan.block_size == 2


@pytest.mark.parametrize("context, reads", [
    (100, (100 + 100 + 32 + 32) / 4),  # roles full, Δ, sparse, sparse; K·P = 32
    (32, 32.0),  # the budget exactly
    (20, 20.0),
])
def test_delta_step_reads(context, reads):
    from rolecall.runtime.policies.delta import DeltaStep

    step = DeltaStep([0, 1, 2, 2], page_size=16, num_pages=2, recent_pages=1)
    assert step.reads(SimpleNamespace(windows=[None] * 4, layers=4), context) == pytest.approx(reads)


# -- quest -----------------------------------------------------------------------------------------------------------------
# pages of 2 keys (D = 1): A = [4, 4], B = [-3, -3], C = [1, -1], then the current page of zeros. Query heads +1
# and -1 in one group bound A by 4 and -4, B by -3 and 3, C by 1 and 1: the max ranks A, B, C; the sum C first
QUEST_KEYS = [4.0, 4.0, -3.0, -3.0, 1.0, -1.0]


@pytest.mark.parametrize("tokens, budget, group, pages", [
    (8, 4, "max", [0, 3]),  # K = 2: the current page and the best
    (8, 4, "sum", [2, 3]),
    (9, 4, "max", [0, 4]),  # one token past: the current page is page 4, of one token
    (9, 4, "sum", [2, 4]),
    (8, 5, "max", [0, 1, 3]),  # K = ceil(5 / 2) = 3
    (8, 2, "max", [3]),  # K = 1: the current page alone
    (8, 1, "sum", [3]),
])
def test_quest_reads_the_current_page_and_the_best_bounds(tokens, budget, group, pages):
    from rolecall.runtime.policies import get_policy

    q = get_policy("quest", budget=budget, page_size=2, dense_layers=1, group=group)
    keys = [[[x] for x in QUEST_KEYS + [0.0] * (tokens - len(QUEST_KEYS))]]
    assert q.plan(_step(0, [[1.0], [-1.0]], keys)).indices is None  # layers before dense_layers read everything
    plan = q.plan(_step(1, [[1.0], [-1.0]], keys))
    assert plan.indices.tolist() == [[pages]] and plan.block_size == 2


@pytest.mark.parametrize("dense, context, reads", [
    (2, 100, (100 + 100 + 32) / 3),  # layers 0 and 1 dense, K·P = 32
    (0, 100, 32.0),
    (3, 100, 100.0),
    (2, 10, 10.0),
])
def test_quest_step_reads(dense, context, reads):
    from rolecall.runtime.policies.quest import QuestStep

    step = QuestStep(page_size=16, num_pages=2, dense_layers=dense, group="max")
    assert step.reads(SimpleNamespace(windows=[None] * 3, layers=3), context) == pytest.approx(reads)


# -- lychee ----------------------------------------------------------------------------------------------------------------
def _choose(params, scores, valid=None):
    from rolecall.runtime.policies import get_policy

    s = torch.tensor([[scores]], dtype=torch.float32)
    v = torch.ones_like(s, dtype=torch.bool) if valid is None else torch.tensor([[valid]])
    return [i for i in get_policy("lychee", **params)._choose(s, v)[0, 0].tolist() if i >= 0]


@pytest.mark.parametrize("params, scores, chosen", [
    ({"budget": 2}, [0.5, 0.1, 0.3, 0.05, 0.05], [0, 4]),  # the last token, then the best
    ({"budget": 3}, [0.5, 0.1, 0.3, 0.05, 0.05], [0, 2, 4]),
    ({"budget": 2, "recent": 2}, [0.5, 0.1, 0.3, 0.05, 0.05], [3, 4]),
    ({"budget": 2, "recent": 0}, [0.5, 0.1, 0.3, 0.05, 0.05], [0, 2]),
    ({"budget": 1, "recent": 3}, [0.5, 0.1, 0.3, 0.05, 0.05], [2, 3, 4]),  # the recent tokens outnumber the budget
    # blocks of 2: K = ceil(budget / 2) blocks, ceil(recent / 2) recent ones
    ({"budget": 3, "block_size": 2}, [0.6, 0.1, 0.3], [0, 2]),
    ({"budget": 4, "block_size": 2}, [0.6, 0.1, 0.3], [0, 2]),
    ({"budget": 5, "block_size": 2}, [0.6, 0.1, 0.3], [0, 1, 2]),
    ({"budget": 1, "block_size": 2, "recent": 3}, [0.6, 0.1, 0.3], [1, 2]),
    ({"budget": 1, "block_size": 2, "recent": 2}, [0.6, 0.1, 0.3], [2]),
    # a ratio of the valid blocks, rounded up
    ({"ratio": 0.5, "recent": 0}, [0.4, 0.3, 0.2, 0.1], [0, 1]),
    ({"ratio": 0.5, "recent": 0}, [0.4, 0.3, 0.2, 0.05, 0.05], [0, 1, 2]),
    ({"ratio": 1.0, "recent": 0}, [0.4, 0.3, 0.2], [0, 1, 2]),
    # a share at the threshold exactly is taken; the largest always is (both, when tied)
    ({"threshold": 0.25, "recent": 0}, [0.5, 0.25, 0.25], [0, 1, 2]),
    ({"threshold": 0.26, "recent": 0}, [0.5, 0.25, 0.25], [0]),
    ({"threshold": 1.0, "recent": 0}, [0.4, 0.4, 0.2], [0, 1]),
    ({"threshold": 1.0, "recent": 1}, [0.5, 0.25, 0.25], [0, 2]),
    # top_p: a block is taken while the mass ranked above it is below top_p
    ({"top_p": 0.5, "recent": 0}, [0.5, 0.375, 0.125], [0]),
    ({"top_p": 0.6, "recent": 0}, [0.5, 0.375, 0.125], [0, 1]),
    ({"top_p": 0.875, "recent": 0}, [0.5, 0.375, 0.125], [0, 1]),
    ({"top_p": 0.9, "recent": 0}, [0.5, 0.375, 0.125], [0, 1, 2]),
])
def test_lychee_set_sizes_at_their_ends(params, scores, chosen):
    assert _choose(params, scores) == chosen


def test_lychee_ratio_counts_valid_blocks_only():
    """5 blocks, the first padding: ceil(0.5 · 4) = 2 of the valid ones."""
    assert _choose({"ratio": 0.5, "recent": 0}, [0.9, 0.4, 0.3, 0.2, 0.1], [False, True, True, True, True]) == [1, 2]


@pytest.mark.parametrize("budget, block, recent, blocks, recent_blocks", [
    (5, 2, 1, 3, 1), (4, 2, 1, 2, 1), (1, 2, 5, 3, 3), (3, 1, 0, 3, 0), (1, 4, 0, 1, 0), (8, 4, 4, 2, 1),
])
def test_lychee_step_block_counts(budget, block, recent, blocks, recent_blocks):
    """max(ceil(budget / block), ceil(recent / block), 1) blocks, ceil(recent / block) of them recent."""
    from rolecall.runtime.policies import get_policy

    p = get_policy("lychee", budget=budget, block_size=block, recent=recent)
    p.retrieval, p.policy_layers = torch.ones(2, 1, dtype=torch.bool), [0, 1]
    step = p.static_step(SimpleNamespace(layers=2, kv_heads=1))
    assert (step.num_blocks, step.recent_blocks) == (blocks, recent_blocks)


@pytest.mark.parametrize("layers, passes", [
    ([0, 1, 2], [[False, True], [True, False], [False, False]]),  # the last layer's choice is read by none
    ([0, 2], [[True, False], [False, False], [False, False]]),  # layer 1 slides: layer 0 passes to layer 2
    ([2], [[False, False]] * 3),
])
def test_lychee_passes_on(layers, passes):
    from rolecall.runtime.policies.lychee import passes_on

    retrieval = torch.tensor([[True, True], [True, False], [False, True]])
    assert passes_on(retrieval, layers).tolist() == passes


# -- lethe -----------------------------------------------------------------------------------------------------------------
def _lethe(weights, **params):
    from rolecall.runtime.policies import get_policy

    p = get_policy("lethe", **params)
    p.weights, p.policy_layers = torch.tensor(weights), list(range(len(weights)))
    return p


@pytest.mark.parametrize("params, weights, logical, caps", [
    # budget: round(budget · w / mean w); Python's round takes a half to the even neighbour
    ({"budget": 10, "sinks": 0}, [1.0, 3.0], 0, [5, 15]),
    ({"budget": 3, "sinks": 0}, [1.0, 3.0], 0, [2, 4]),  # 1.5 → 2, 4.5 → 4
    ({"budget": 3, "sinks": 4}, [1.0, 3.0], 0, [6, 6]),  # at least sinks + 2
    # a share of the context: ceil(min(w · ratio / mean, 1) · logical)
    ({"sparse_ratio": 0.5, "sinks": 0}, [1.0, 1.0], 9, [5, 5]),
    ({"sparse_ratio": 0.5, "sinks": 0}, [1.0, 1.0], 10, [5, 5]),
    ({"sparse_ratio": 0.5, "sinks": 0}, [1.0, 1.0], 2, [2, 2]),  # ceil(1) = 1, raised to sinks + 2
    ({"sparse_ratio": 1.0, "sinks": 0}, [3.0, 1.0], 10, [10, 5]),  # a share above 1 reads the context
    ({"sinks": 0}, [0.25, 0.5], 10, [3, 5]),  # the manifest's shares as they are
])
def test_lethe_capacity(params, weights, logical, caps):
    p = _lethe(weights, **params)
    assert [p.capacity(i, logical) for i in range(len(weights))] == caps


@pytest.mark.parametrize("ratio, cap, recent", [(0.1, 10, 1), (0.1, 11, 2), (1.0, 6, 5), (0.0, 6, 0), (0.1, 1, 0),
                                                (0.5, 4, 2)])
def test_lethe_recent_slots(ratio, cap, recent):
    """min(ceil(recent_ratio · cap), cap − 1): the current token's slot is always left."""
    assert _lethe([1.0], budget=8, recent_ratio=ratio).recent_slots(cap) == recent


@pytest.mark.parametrize("scores, cand, room, segments, tau, picked", [
    # one segment: the top k, k = min(room, reach); reach = 1 + #{running mass of the sorted scores < τ · total}
    ([4, 3, 2, 1], None, 4, 1, 0.4, [0]),  # running mass 4 = τ · 10 exactly is not below it
    ([4, 3, 2, 1], None, 4, 1, 0.41, [0, 1]),
    ([4, 3, 2, 1], None, 4, 1, 0.9, [0, 1, 2]),  # 9 = 9
    ([4, 3, 2, 1], None, 4, 1, 0.91, [0, 1, 2, 3]),
    ([4, 3, 2, 1], None, 4, 1, 0.0, [0]),
    ([4, 3, 2, 1], None, 2, 1, 1.0, [0, 1]),  # the room binds
    ([4, 3, 2, 1], None, 0, 1, 1.0, []),
    # two segments [0, 1], [2, 3] of mass 7 and 3: quotas by largest remainder of k · mass share
    ([4, 3, 2, 1], None, 2, 2, 1.0, [0, 2]),  # 1.4, 0.6 → 1, 1
    ([4, 3, 2, 1], None, 3, 2, 1.0, [0, 1, 2]),  # 2.1, 0.9 → 2, 1
    ([4, 3, 2, 1], None, 1, 2, 1.0, [0]),  # 0.7, 0.3 → 1, 0
    # three segments of mass 3, 3, 4 and k = 2: 0.6, 0.6, 0.8 floor to 0, 0, 0; the two largest remainders get
    # one each, the earlier segment on a tie
    ([2, 1, 2, 1, 3, 1], None, 2, 3, 1.0, [0, 4]),
    # segments [0, 1], [2] of mass 2 and 8: quota 0, 2; the second holds one token, the rest goes to the best
    # other candidate, the earlier slot on a tie
    ([1, 1, 8], None, 2, 2, 1.0, [0, 2]),
    ([9, 1, 2, 9], [False, True, True, False], 1, 1, 1.0, [2]),  # only candidates
])
def test_lethe_segmented_top_k_with_a_breakpoint(scores, cand, room, segments, tau, picked):
    from rolecall.runtime.policies.lethe import _segmented_on_device

    s = torch.tensor(scores, dtype=torch.float32)
    c = torch.ones(len(scores), dtype=torch.bool) if cand is None else torch.tensor(cand)
    got = _lethe([1.0], budget=8, segments=segments, tau=tau)._segmented(s, c, room)
    assert got.nonzero().flatten().tolist() == picked
    on_device = _segmented_on_device(s[None], c[None], torch.tensor([room]), segments, tau)[0]
    assert on_device.nonzero().flatten().tolist() == picked


@pytest.mark.parametrize("scores, sinks, ratio, kept", [
    # cap 4: the first `sinks` valid slots, the last ceil(ratio · 4) and the current one kept; the rest of the
    # room to the best candidates
    ([0.0, 0.1, 0.5, 0.4, 0.05, 0.0], 1, 0.25, [0, 2, 3, 5]),
    ([0.0, 0.1, 0.5, 0.4, 0.05, 0.0], 2, 0.25, [0, 1, 2, 5]),  # a second sink
    ([0.0, 0.1, 0.5, 0.4, 0.05, 0.0], 1, 0.5, [0, 2, 4, 5]),  # a second recent slot
    ([0.0, 0.1, 0.5, 0.4, 0.05, 0.0], 0, 0.25, [1, 2, 3, 5]),  # no sink: room for three
])
def test_lethe_keeps_sinks_recent_and_the_best(scores, sinks, ratio, kept):
    from rolecall.runtime.policies.lethe import keep_on_device

    p = _lethe([1.0], budget=4, sinks=sinks, recent_ratio=ratio, segments=1, tau=1.0)
    s = torch.tensor([scores])
    ok = torch.ones_like(s, dtype=torch.bool)
    assert p._keep(s, ok, 4).tolist() == [kept]
    got = keep_on_device(s, ok, ok, 4, sinks, p.recent_slots(4), 1, 1.0)
    assert got.nonzero()[:, 1].tolist() == kept


@pytest.mark.parametrize("keep, order", [
    ([True, False, True, False], [0, 2, 1, 3]), ([False, False, True], [2, 0, 1]), ([True] * 3, [0, 1, 2]),
    ([False] * 3, [0, 1, 2]), ([False, True], [1, 0]),
])
def test_lethe_compaction_order(keep, order):
    from rolecall.runtime.policies.lethe import compaction_order

    assert compaction_order(torch.tensor([keep])).tolist() == [order]


# -- vattention --------------------------------------------------------------------------------------------------------------
HEAVY_SCORES = [9.0, 9.0, 1.0, 4.0, 3.0, 2.0, 9.0, 9.0]


@pytest.mark.parametrize("first, sinks, window, heavy, slots", [
    (0, 2, 2, 2, [3, 4]),  # slots 2..5 lie outside sinks 0, 1 and the window 6, 7
    (0, 2, 2, 5, [3, 4, 5, 2, -1]),  # fewer than asked: -1
    (1, 2, 2, 4, [3, 4, 5, -1]),  # the sinks start at the first valid slot
    (0, 2, 1, 2, [6, 3]),  # a window of 1: slot 6 is outside it
    (0, 0, 6, 2, [0, 1]),  # no sinks: slot 0; the window's first slot, 2, is inside it
])
def test_vattention_heavy_hitters(first, sinks, window, heavy, slots):
    from rolecall.runtime.policies.vattention import heavy_hitters

    got = heavy_hitters(torch.tensor([[HEAVY_SCORES]]), torch.tensor([first]), 7, sinks, window, heavy)
    assert sorted(got[0, 0].tolist()) == sorted(slots)


@pytest.mark.parametrize("first, last, sinks, window, heavy, slots", [
    (0, 7, 2, 2, [3, 4], [0, 1, 6, 7, 3, 4]),
    (5, 7, 2, 2, [-1], [5, 6, -1, 7, -1]),  # slot 6 is a sink, not the window's too
    (0, 1, 4, 2, [], [0, 1, -1, -1, -1, -1]),  # sinks past the last slot are absent
    (6, 7, 2, 1, [], [6, 7, -1]),
    (0, 9, 1, 3, [], [0, 7, 8, 9]),  # the window's last slot is `last`
])
def test_vattention_fixed_slots(first, last, sinks, window, heavy, slots):
    from rolecall.runtime.policies.vattention import fixed_slots

    h = torch.tensor([[heavy]], dtype=torch.long).view(1, 1, len(heavy))
    assert fixed_slots(torch.tensor([first]), last, sinks, window, h).tolist() == [[slots]]


@pytest.mark.parametrize("fixed, first, ranks", [
    ([0, 1, 6, 7, 3, 4], 0, [0, 1, 2, 3]),
    ([2, 5, -1], 2, [0, 1, 2, 5]),
    ([-1, -1], 3, [0, 4]),
    ([9], 0, [8]),  # a fixed slot after every rank asked
    ([8], 0, [8]),  # a fixed slot at the rank's own place
])
def test_vattention_residual_slots_against_the_listed_complement(fixed, first, ranks):
    from rolecall.runtime.policies.vattention import residual_slots

    free = [s for s in range(first, 12) if s not in fixed]
    got = residual_slots(torch.tensor([[ranks]]), torch.tensor([[fixed]]), torch.tensor([first]))
    assert got.tolist() == [[[free[r] for r in ranks]]]


@pytest.mark.parametrize("n_r, pilot, max_sample, size", [
    # a residual of zero spread needs one draw; one no larger than the pilot is read whole
    (3, 2, None, 1), (2, 2, None, 2), (1, 2, None, 1), (0, 2, None, 0), (2, 2, 1, 1), (5, 4, 3, 1),
])
def test_vattention_sample_size_at_the_pilots_size(n_r, pilot, max_sample, size):
    from rolecall.runtime.policies import get_policy

    p = get_policy("vattention", pilot=pilot, max_sample=max_sample)
    got = p._sample_size(torch.zeros(1, 1, 1, pilot), torch.ones(1, 1, pilot, 1), torch.ones(1, 1, 1, 1),
                         torch.tensor([[n_r]]))
    assert got.tolist() == [[size]]


def test_vattention_sample_size_rounds_the_bound_up():
    """Pilot logits 0 and a (values 0, so b_N = 0): b_D = (z · n_r · σ / (η · (1 + n_r · mean)))², σ the two
    draws' sample deviation, in plain floats; the size is its ceiling."""
    from rolecall.runtime.policies import get_policy

    p = get_policy("vattention", pilot=2)
    a, n_r = math.log(1.0243), 1000
    e = [1.0, 1.0243]
    mean = sum(e) / 2
    sd = math.sqrt(sum((x - mean) ** 2 for x in e))
    z, eta = NormalDist().inv_cdf(1 - 0.05 / 4), 0.05 / 2.05
    b_d = (z * n_r * sd / (eta * (1 + n_r * mean))) ** 2
    assert 2.2 < b_d < 2.8
    got = p._sample_size(torch.tensor([[[[0.0, a]]]]), torch.zeros(1, 1, 2, 1), torch.ones(1, 1, 1, 1),
                         torch.tensor([[n_r]]))
    assert got.tolist() == [[math.ceil(b_d)]]


@pytest.mark.parametrize("size, width, drawn, weight", [
    (3, 3, [2, 3, 4], 0.0),  # the whole residual (slots 2, 3, 4) in order, at weight n_r / size = 1
    (2, 3, None, math.log(3 / 2)),  # two draws of it at weight 3/2, the third place empty
    (3, 4, [2, 3, 4, -1], 0.0),
])
def test_vattention_sampled_plan_reads_the_residual_whole_at_its_size(size, width, drawn, weight):
    from rolecall.runtime.policies import get_policy

    p = get_policy("vattention")
    plan = p.sampled_plan(torch.tensor([[[0, 1]]]), torch.tensor([0]), torch.tensor([[3]]), torch.tensor([[size]]),
                          width, 5, 0)
    ids, lw = plan.indices[0, 0].tolist(), plan.log_weights[0, 0].tolist()
    assert ids[:2] == [0, 1] and lw[:2] == [0.0, 0.0]
    if drawn is not None:
        assert ids[2:] == drawn
    else:
        assert all(i in (2, 3, 4) for i in ids[2:4]) and ids[4] == -1
    assert lw[2:2 + size] == pytest.approx([weight] * size) and all(w == 0.0 for w in lw[2 + size:])
    assert int(plan.info["sampled"]) == size


def test_vattention_sampled_plan_of_width_0_is_the_fixed_set():
    from rolecall.runtime.policies import get_policy

    plan = get_policy("vattention").sampled_plan(torch.tensor([[[0, 1]]]), torch.tensor([0]), torch.tensor([[3]]),
                                                 torch.tensor([[0]]), 0, 5, 0)
    assert plan.indices.tolist() == [[[0, 1]]] and plan.log_weights is None and plan.info == {"sampled": 0}


@pytest.mark.parametrize("roles, context, reads", [
    # sinks 4 + window 8 + heavy 8 + pilot 4 + max_sample 8 = 32: a full layer reads the context, a Δ-layer the
    # context and the set, a sparse layer the set
    ([0, 1, 2], 100, (100 + 132 + 32) / 3),
    ([0, 1, 2], 32, (32 + 64 + 32) / 3),
    ([0, 1, 2], 20, (20 + 40 + 20) / 3),
    (None, 100, 132.0),
])
def test_vattention_step_reads(roles, context, reads):
    from rolecall.runtime.policies import get_policy
    from rolecall.runtime.policies.vattention import VAttentionStep

    p = get_policy("vattention", sinks=4, window=8, heavy=8, pilot=4, max_sample=8)
    p.roles = roles
    assert VAttentionStep(p).reads(SimpleNamespace(layers=3), context) == pytest.approx(reads)


@pytest.mark.parametrize("roles, layer_types, early", [
    # a sparse layer before the first Δ-layer has no pages to read: refused, naming it
    ([2, 1, 2], None, [0]),
    ([0, 2, 2, 1, 2], None, [1, 2]),
    ([2, 2, 2], None, [0, 1, 2]),  # no Δ-layer at all
    # a Δ-layer first, or full layers before it, binds; a sliding layer never reads pages, whatever its role
    ([1, 2, 2], None, []),
    ([0, 0, 1, 2], None, []),
    ([2, 1, 2], ["sliding_attention", "full_attention", "full_attention"], []),
    # a Δ-layer that is sliding chooses no pages: the sparse layer after it still has none
    ([0, 1, 2], ["full_attention", "sliding_attention", "full_attention"], [2]),
])
def test_delta_refuses_sparse_layers_before_any_delta_layer(roles, layer_types, early):
    from rolecall.core.manifest import ModelIdentity, RoleManifest
    from rolecall.runtime.policies import PolicyError, get_policy

    manifest = RoleManifest(ModelIdentity(len(roles), 2, 1, 8), layer_role=torch.tensor(roles, dtype=torch.int8))
    config = SimpleNamespace(layer_types=layer_types)
    policy = get_policy("delta", budget=64)
    if early:
        with pytest.raises(PolicyError, match=rf"sparse layers {re.escape(str(early))} come before any Δ-layer"):
            policy.bind(manifest, config)
    else:
        policy.bind(manifest, config)
        assert policy.roles == roles
