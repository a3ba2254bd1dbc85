"""Quest: the page bound really bounds every logit, pages match a brute-force reference, and a budget that
covers the context decodes exactly like dense attention."""

import math

import pytest
import torch

from rolecall.runtime import attach
from rolecall.runtime.policies import PolicyError, Step, get_policy
from rolecall.runtime.policies.quest import page_bounds, page_minmax
from tests.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def random_step(layer, b=2, hq=6, hkv=2, t=101, d=8, pad=13, seed=0):
    torch.manual_seed(seed)
    q, k, v = torch.randn(b, hq, d) * 2, torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    keep = torch.ones(b, t, dtype=torch.bool)
    keep[-1, :pad] = False  # left padding in the last row
    return q, k, v, keep


def brute_pages(q, k, keep, scale, page_size, num_pages, group):
    """One sequence: q [Hq, D], k [Hkv, T, D], keep [T] → per KV head the sorted page ids, from the formula."""
    hq, d = q.shape
    hkv, t, _ = k.shape
    g = hq // hkv
    n = math.ceil(t / page_size)
    chosen = []
    for h in range(hkv):
        scores = []
        for u in range(n):
            toks = [i for i in range(u * page_size, min((u + 1) * page_size, t)) if keep[i]]
            if not toks:
                scores.append(-math.inf)
                continue
            lo = [min(float(k[h, i, j]) for i in toks) for j in range(d)]
            hi = [max(float(k[h, i, j]) for i in toks) for j in range(d)]
            bounds = [scale * sum(max(float(q[h * g + r, j]) * lo[j], float(q[h * g + r, j]) * hi[j]) for j in range(d))
                      for r in range(g)]
            scores.append(max(bounds) if group == "max" else sum(bounds))
        others = sorted((u for u in range(n - 1) if scores[u] > -math.inf), key=lambda u: -scores[u])
        chosen.append(sorted([n - 1] + others[: min(num_pages, n) - 1]))
    return chosen


@pytest.mark.parametrize("page_size,t", [(16, 101), (7, 64), (4, 5)])
def test_page_bound_is_above_every_logit_in_the_page(page_size, t):
    q, k, _, keep = random_step(0, t=t, seed=page_size)
    scale = 0.3
    kmin, kmax = page_minmax(k, keep, page_size)
    bound = page_bounds(q, kmin, kmax, scale)  # [B, Hq, n]
    logits = torch.einsum("bhgd,bhtd->bhgt", q.view(2, 2, 3, 8), k).reshape(2, 6, t) * scale
    page = torch.arange(t) // page_size
    slack = bound[:, :, page] - logits  # [B, Hq, T]
    assert float(slack[keep[:, None, :].expand_as(slack)].min()) >= -1e-5
    # Tight for a page of one token: the bound is the logit itself.
    one_min, one_max = page_minmax(k, keep, 1)
    exact = page_bounds(q, one_min, one_max, scale)
    assert torch.allclose(exact[:, :, :t][keep[:, None, :].expand_as(logits)], logits[keep[:, None, :].expand_as(logits)],
                          atol=1e-5)
    # Pages that hold only padding can never be chosen.
    assert bool((bound[-1, :, : (13 // page_size)] == -math.inf).all())


@pytest.mark.parametrize("group", ["max", "sum"])
@pytest.mark.parametrize("budget,page_size", [(48, 16), (20, 4), (1, 16), (4096, 16)])
def test_selection_matches_the_brute_force_reference(group, budget, page_size):
    q, k, v, keep = random_step(3, seed=budget + page_size)
    policy = get_policy("quest", budget=budget, page_size=page_size, group=group)
    plan = policy.plan(Step(3, q, k, v, keep, 0.25, {}))
    assert plan.block_size == page_size
    for row in range(2):
        want = brute_pages(q[row], k[row], keep[row], 0.25, page_size, math.ceil(budget / page_size), group)
        for h in range(2):
            got = [u for u in plan.indices[row, h].tolist() if u >= 0]
            assert got == want[h]


def test_incremental_metadata_equals_recomputing_over_steps():
    """Decode steps append one slot at a time; the pages kept in scratch (a buffer that grows past its first
    16 pages here) must match a fresh computation."""
    q, k, v, keep = random_step(2, t=80)
    policy = get_policy("quest", budget=16, page_size=4)
    scratch = {}
    for t in range(33, 81):
        torch.manual_seed(t)
        q = torch.randn(2, 6, 8) * 2
        got = policy.plan(Step(2, q, k[:, :, :t], v[:, :, :t], keep[:, :t], 0.25, scratch)).indices
        want = policy.plan(Step(2, q, k[:, :, :t], v[:, :, :t], keep[:, :t], 0.25, {})).indices
        assert torch.equal(got, want)
        kmin, kmax = page_minmax(k[:, :, :t], keep[:, :t], 4)
        held_min, held_max, count = scratch["quest.pages.2"]
        assert count == t // 4 and held_min.shape[2] >= count
        assert torch.equal(held_min[:, :, :count], kmin[:, :, :count])
        assert torch.equal(held_max[:, :, :count], kmax[:, :, :count])
    assert held_min.shape[2] == 32


def test_pages_held_for_a_longer_sequence_are_dropped_when_a_shorter_one_reuses_the_scratch():
    """A scratch that holds 20 full pages of an 80-token sequence, reused by a 41-token one (10 full pages,
    other keys): every bound comes from the new keys, so the choice is the brute-force one of those keys."""
    policy = get_policy("quest", budget=16, page_size=4)
    scratch = {}
    q, k, v, keep = random_step(2, t=80, seed=1)
    policy.plan(Step(2, q, k, v, keep, 0.25, scratch))
    assert scratch["quest.pages.2"][2] == 20
    q, k, v, keep = random_step(2, t=41, seed=2)
    plan = policy.plan(Step(2, q, k, v, keep, 0.25, scratch))
    assert scratch["quest.pages.2"][2] == 10
    for row in range(2):
        want = brute_pages(q[row], k[row], keep[row], 0.25, 4, 4, "max")
        for h in range(2):
            assert [u for u in plan.indices[row, h].tolist() if u >= 0] == want[h]


def test_first_layers_stay_dense():
    q, k, v, keep = random_step(0)
    policy = get_policy("quest", budget=16)
    assert policy.plan(Step(1, q, k, v, keep, 0.25, {})).indices is None
    assert policy.plan(Step(2, q, k, v, keep, 0.25, {})).indices is not None


GEN = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=259)


def batch(size, length=48):
    ids = torch.randint(0, 256, (size, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for row in range(1, size):
        mask[row, : 7 * row] = 0
    return ids, mask


@pytest.mark.parametrize("family,kv_heads", [("llama", 2), ("qwen3", 1)])
def test_a_budget_covering_the_context_equals_dense(family, kv_heads):
    model = tiny_model(family, layers=4, heads=4, kv_heads=kv_heads, head_dim=16)
    ids, mask = batch(3)
    want = model.generate(input_ids=ids, attention_mask=mask, **GEN).logits
    for group in ("max", "sum"):
        with attach(model, None, "quest", budget=64, dense_layers=0, group=group) as session:
            got = session.generate(input_ids=ids, attention_mask=mask, **GEN).logits
        for a, b in zip(got, want):
            assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())
        assert session.summary()["attended_fraction"] == pytest.approx(1.0)


def test_a_small_budget_reads_its_pages_and_changes_the_logits():
    model = tiny_model("llama", layers=4, heads=4, kv_heads=2, head_dim=16)
    ids, mask = batch(1, length=127)
    want = model.generate(input_ids=ids, attention_mask=mask, **GEN).logits
    with attach(model, None, "quest", budget=32, page_size=8) as session:
        got = session.generate(input_ids=ids, attention_mask=mask, **GEN).logits
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) > 1e-3
    fractions = session.stats.attended_fraction()
    assert fractions[0] == fractions[1] == 1.0
    # 3 decode steps at 128, 129, 130 slots: 4 pages of 8 each, except that the last page may be partial.
    assert fractions[2] == pytest.approx((32 + 25 + 26) / (128 + 129 + 130))


@pytest.mark.parametrize("params,match", [
    ({"budget": 0}, "budget must be a positive integer"),
    ({"budget": 10.5}, "budget must be a positive integer"),
    ({"page_size": -1}, "page_size must be a positive integer"),
    ({"dense_layers": -2}, "dense_layers must be a number ≥ 0"),
    ({"group": "mean"}, "group must be one of max, sum"),
    ({"pages": 4}, "its parameters are: budget, page_size, dense_layers, group"),
])
def test_bad_parameters_are_one_line_policy_errors(params, match):
    with pytest.raises(PolicyError, match=match) as info:
        get_policy("quest", **params)
    assert "\n" not in str(info.value)
