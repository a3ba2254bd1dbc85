"""DELTA: page selection against the paper's formula, and sparse layers reading the Δ-layer's pages."""

import math

import pytest
import torch

from rolecall.core.manifest import ModelIdentity, RoleManifest
from rolecall.runtime.kernels.sparse_attention import sparse_decode_attention
from rolecall.runtime.policies import PolicyError, Step, get_policy
from rolecall.runtime.policies.delta import select_pages


def brute_select(probs, page_size, num_pages, recent_pages):
    """probs [Hq, T] of one sequence → sorted page ids, straight from the formula."""
    hq, t = probs.shape
    n = math.ceil(t / page_size)
    score = []
    for u in range(n):
        score.append(sum(max(float(probs[h, i]) for h in range(hq)) for i in range(u * page_size, min((u + 1) * page_size, t))))
    recent = list(range(max(n - recent_pages, 0), n))
    others = sorted((u for u in range(n) if u not in recent), key=lambda u: -score[u])
    return sorted(recent + others[: max(min(num_pages, n) - len(recent), 0)])


@pytest.mark.parametrize("t,p,k,recent", [(1000, 16, 8, 2), (257, 16, 64, 8), (100, 7, 5, 0), (33, 16, 2, 2), (5, 16, 4, 1)])
def test_select_pages_matches_the_formula_on_random_attention(t, p, k, recent):
    torch.manual_seed(t + p)
    probs = (torch.randn(3, 6, t) * 3).softmax(-1)  # [B, Hq, T], peaked like real attention
    got = select_pages(probs.amax(1), p, k, recent)
    assert got.shape == (3, min(k, math.ceil(t / p)))
    for b in range(3):
        assert got[b].tolist() == brute_select(probs[b], p, k, recent)


def test_select_pages_rejects_bad_arguments():
    with pytest.raises(PolicyError, match="recent_pages"):
        select_pages(torch.rand(1, 64), 16, 2, 3)
    with pytest.raises(PolicyError, match="page_size"):
        select_pages(torch.rand(1, 64), 0, 2, 1)


def test_budget_is_a_synonym_for_pages():
    assert get_policy("delta", budget=1024).num_pages == 64
    assert get_policy("delta", budget=100, page_size=16).num_pages == 7
    defaults = get_policy("delta")
    assert (defaults.num_pages, defaults.recent_pages, defaults.page_size) == (64, 8, 16)


def test_sparse_layer_reads_exactly_the_delta_layer_pages():
    torch.manual_seed(3)
    b, hq, hkv, t, d, p = 2, 6, 2, 90, 8, 8
    manifest = RoleManifest(ModelIdentity(4, hq, hkv, d), layer_role=torch.tensor([0, 1, 2, 2], dtype=torch.int8))
    policy = get_policy("delta", num_pages=4, recent_pages=1, page_size=p)
    policy.bind(manifest, None)
    keep = torch.ones(b, t, dtype=torch.bool)
    keep[1, :20] = False
    scratch = {}
    q1, k1 = torch.randn(b, hq, d) * 2, torch.randn(b, hkv, t, d)
    plan = policy.plan(Step(1, q1, k1, torch.randn(b, hkv, t, d), keep, 0.5, scratch))
    assert plan.indices is None  # the Δ-layer itself reads everything
    q2, k2, v2 = torch.randn(b, hq, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    plan = policy.plan(Step(2, q2, k2, v2, keep, 0.5, scratch))
    out, _ = sparse_decode_attention(q2, k2, v2, plan.indices, scale=0.5, block_size=plan.block_size, key_mask=keep)
    for row in range(b):
        logits = torch.einsum("hd,htd->ht", q1[row], k1[row].repeat_interleave(hq // hkv, 0)) * 0.5
        probs = logits.masked_fill(~keep[row], -math.inf).softmax(-1)
        pages = brute_select(probs, p, 4, 1)
        tokens = [i for u in pages for i in range(u * p, min((u + 1) * p, t)) if keep[row, i]]
        kk, vv = k2[row][:, tokens].repeat_interleave(hq // hkv, 0), v2[row][:, tokens].repeat_interleave(hq // hkv, 0)
        want = torch.einsum("ht,htd->hd", (torch.einsum("hd,htd->ht", q2[row], kk) * 0.5).softmax(-1), vv)
        assert torch.allclose(out[row], want, atol=1e-5)


def test_per_head_pages_follow_each_kv_groups_own_scores():
    """per_head=True: each KV head of a sparse layer reads the pages brute force picks from its own query group's
    probabilities at the Δ-layer (and with one KV head it is the shared selection)."""
    torch.manual_seed(5)
    b, hq, hkv, t, d, p = 2, 6, 3, 70, 8, 8
    g = hq // hkv
    manifest = RoleManifest(ModelIdentity(3, hq, hkv, d), layer_role=torch.tensor([1, 2, 2], dtype=torch.int8))
    policy = get_policy("delta", num_pages=3, recent_pages=1, page_size=p, per_head=True)
    policy.bind(manifest, None)
    keep = torch.ones(b, t, dtype=torch.bool)
    keep[0, :11] = False
    scratch = {}
    q, k = torch.randn(b, hq, d) * 2, torch.randn(b, hkv, t, d)
    policy.plan(Step(0, q, k, torch.randn(b, hkv, t, d), keep, 0.5, scratch))
    plan = policy.plan(Step(1, torch.randn(b, hq, d), k, k, keep, 0.5, scratch))
    assert plan.indices.shape == (b, hkv, 3)
    for row in range(b):
        logits = torch.einsum("hd,htd->ht", q[row], k[row].repeat_interleave(g, 0)) * 0.5
        probs = logits.masked_fill(~keep[row], -math.inf).softmax(-1)  # [Hq, T]
        for h in range(hkv):
            assert plan.indices[row, h].tolist() == brute_select(probs[h * g:(h + 1) * g], p, 3, 1), (row, h)
    assert len({tuple(plan.indices[0, h].tolist()) for h in range(hkv)}) > 1  # the heads do differ here
    with pytest.raises(PolicyError, match="per_head must be true or false"):
        get_policy("delta", per_head="yes")


def test_refine_keeps_per_kv_head_the_candidates_with_the_highest_quest_bound():
    """refine=R: the Δ-layer picks R·K candidates (brute force on its probabilities); each sparse layer keeps, per
    KV head, the recent page and the K − 1 candidates whose bound max_g scale·Σ_d max(q·kmin, q·kmax), over the
    page's readable keys of that layer, is highest — all by explicit loops here."""
    torch.manual_seed(7)
    b, hq, hkv, t, d, p, k_pages, r = 2, 6, 3, 150, 8, 8, 3, 3
    g = hq // hkv
    manifest = RoleManifest(ModelIdentity(3, hq, hkv, d), layer_role=torch.tensor([1, 2, 2], dtype=torch.int8))
    policy = get_policy("delta", num_pages=k_pages, recent_pages=1, page_size=p, refine=r)
    policy.bind(manifest, None)
    keep = torch.ones(b, t, dtype=torch.bool)
    keep[1, :13] = False  # left padding: a partly readable first page
    scratch = {}
    q0, k0 = torch.randn(b, hq, d) * 2, torch.randn(b, hkv, t, d)
    policy.plan(Step(0, q0, k0, k0, keep, 0.5, scratch))
    q1, k1 = torch.randn(b, hq, d) * 2, torch.randn(b, hkv, t, d)
    plan = policy.plan(Step(1, q1, k1, k1, keep, 0.5, scratch))
    assert plan.indices.shape == (b, hkv, k_pages)
    n = math.ceil(t / p)
    for row in range(b):
        logits = torch.einsum("hd,htd->ht", q0[row], k0[row].repeat_interleave(g, 0)) * 0.5
        candidates = brute_select(logits.masked_fill(~keep[row], -math.inf).softmax(-1), p, k_pages * r, 1)
        for h in range(hkv):
            bound = {}
            for u in candidates:
                slots = [i for i in range(u * p, min((u + 1) * p, t)) if keep[row, i]]
                kk = k1[row, h, slots]  # [S, D]
                lo, hi = kk.min(0).values, kk.max(0).values
                bound[u] = max(float(sum(max(q1[row, hh, j] * lo[j], q1[row, hh, j] * hi[j]) for j in range(d)) * 0.5)
                               for hh in range(h * g, (h + 1) * g))
            recent = max(candidates)
            rest = sorted((u for u in candidates if u != recent), key=lambda u: -bound[u])[:k_pages - 1]
            assert plan.indices[row, h].tolist() == sorted([*rest, recent]), (row, h)
            assert set(plan.indices[row, h].tolist()) <= set(candidates) and recent == n - 1
    assert len({tuple(plan.indices[0, h].tolist()) for h in range(hkv)}) > 1  # each head refines its own way
    with pytest.raises(PolicyError, match="refine must be an integer"):
        get_policy("delta", refine=0)


def test_per_head_pages_take_the_max_over_the_group_not_the_mean():
    """Two query heads on one KV head, one-hot keys at tokens 0, 2 and 4 (pages of 2): head 0 puts 0.6 on token 0
    and 0.4 on token 2, head 1 0.4 on token 2 and 0.6 on token 4 (the recent page). DELTA's score Σ_page max_h p_h
    gives page 0 0.6 and page 1 0.4, so page 0 joins the recent page; a mean would give 0.3 and 0.4 and pick page 1."""
    big = 40.0
    manifest = RoleManifest(ModelIdentity(2, 2, 1, 3), layer_role=torch.tensor([1, 2], dtype=torch.int8))
    policy = get_policy("delta", num_pages=2, recent_pages=1, page_size=2, per_head=True)
    policy.bind(manifest, None)
    k = torch.zeros(1, 1, 6, 3)
    k[0, 0, 0, 0] = k[0, 0, 2, 1] = k[0, 0, 4, 2] = 1.0
    q = torch.tensor([[[big + math.log(0.6), big + math.log(0.4), -big],
                       [-big, big + math.log(0.4), big + math.log(0.6)]]])
    keep, scratch = torch.ones(1, 6, dtype=torch.bool), {}
    policy.plan(Step(0, q, k, k, keep, 1.0, scratch))
    plan = policy.plan(Step(1, q, k, k, keep, 1.0, scratch))
    assert sorted(plan.indices[0, 0].tolist()) == [0, 2]
