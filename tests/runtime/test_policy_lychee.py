"""LycheeDecode: sparse heads read what the same head index chose one layer earlier, in all four modes."""

import math

import pytest
import torch

from rolecall.core.manifest import ModelIdentity, RoleManifest
from rolecall.runtime.kernels.sparse_attention import indices_to_mask
from rolecall.runtime.policies import Step, get_policy

B, HQ, HKV, T, D = 2, 4, 2, 50, 8


def head_scores(q, k, keep):
    """Per KV head, max over its query heads of the softmax probability: [B, Hkv, T] by loops."""
    out = torch.zeros(B, HKV, T)
    for b in range(B):
        for h in range(HQ):
            logits = (k[b, h // 2] @ q[b, h]) * 0.5
            probs = logits.masked_fill(~keep[b], -math.inf).softmax(-1)
            out[b, h // 2] = torch.maximum(out[b, h // 2], probs)
    return out


def brute_choice(scores, keep, mode, value, recent):
    """One row of scores [T] → the set of token ids the mode keeps (block size 1)."""
    ids = [i for i in range(T) if keep[i]]
    forced = {i for i in range(T - recent, T)} if recent else set()
    ranked = sorted(ids, key=lambda i: -float(scores[i]))
    if mode in ("budget", "ratio"):
        k = value if mode == "budget" else math.ceil(value * len(ids))
        rest = [i for i in ranked if i not in forced]
        return sorted(forced | set(rest[: max(k, recent, 1) - len(forced)]))
    total = sum(float(scores[i]) for i in ids)
    if mode == "top_p":
        chosen, mass = set(), 0.0
        for i in ranked:
            if mass >= value * total:
                break
            chosen.add(i)
            mass += float(scores[i])
        return sorted(chosen | forced)
    return sorted({i for i in ids if float(scores[i]) / total >= value} | {ranked[0]} | forced)


@pytest.mark.parametrize("mode,value", [("budget", 7), ("ratio", 0.2), ("top_p", 0.6), ("threshold", 0.03)])
def test_sparse_heads_read_the_previous_layers_choice(mode, value):
    torch.manual_seed(5)
    roles = torch.tensor([[1, 1], [0, 1], [0, 0]], dtype=torch.int8)
    policy = get_policy("lychee", **{mode: value}, recent=2)
    policy.bind(RoleManifest(ModelIdentity(3, HQ, HKV, D), head_role=roles), None)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, :9] = False
    scratch = {}
    steps = [(torch.randn(B, HQ, D) * 3, torch.randn(B, HKV, T, D)) for _ in range(3)]
    reads = []
    for layer, (q, k) in enumerate(steps):
        plan = policy.plan(Step(layer, q, k, k, keep, 0.5, scratch))
        reads.append(indices_to_mask(plan.indices, 1, T, (B, HKV)) & keep[:, None])
    choice = [[[brute_choice(head_scores(q, k, keep)[b, h], keep[b], mode, value, 2) for h in range(HKV)]
               for b in range(B)] for q, k in steps]
    for b in range(B):
        for h in range(HKV):
            everything = keep[b].nonzero().flatten().tolist()
            assert reads[0][b, h].nonzero().flatten().tolist() == everything  # layer 0: all retrieval
        # layer 1: head 0 sparse reads layer 0's head-0 choice; head 1 retrieval reads everything
        assert reads[1][b, 0].nonzero().flatten().tolist() == choice[0][b][0]
        assert reads[1][b, 1].nonzero().flatten().tolist() == keep[b].nonzero().flatten().tolist()
        # layer 2, both sparse: head 0 still inherits layer 0's choice (passed on by a sparse head), head 1 layer 1's
        assert reads[2][b, 0].nonzero().flatten().tolist() == choice[0][b][0]
        assert reads[2][b, 1].nonzero().flatten().tolist() == choice[1][b][1]


def test_blocks_are_scored_by_their_sum():
    torch.manual_seed(6)
    policy = get_policy("lychee", budget=16, block_size=8, recent=0)
    policy.bind(RoleManifest(ModelIdentity(2, HQ, HKV, D), head_role=torch.tensor([[1, 1], [0, 0]], dtype=torch.int8)), None)
    keep = torch.ones(B, T, dtype=torch.bool)
    q, k = torch.randn(B, HQ, D) * 3, torch.randn(B, HKV, T, D)
    scratch = {}
    policy.plan(Step(0, q, k, k, keep, 0.5, scratch))
    scores = head_scores(q, k, keep)
    for b in range(B):
        for h in range(HKV):
            blocks = [float(scores[b, h, i * 8:(i + 1) * 8].sum()) for i in range(math.ceil(T / 8))]
            want = sorted(sorted(range(len(blocks)), key=lambda i: -blocks[i])[:2])
            assert scratch["lychee.sets"][b, h].tolist() == want


def test_only_choices_a_later_layer_reads_are_made():
    """A retrieval head's choice is read by the same head index in the next layer if that head is sparse there;
    a retrieval head there replaces it and a sparse one passes it on, so nothing later reads it otherwise."""
    from rolecall.runtime.policies.lychee import passes_on

    retrieval = torch.tensor([[1, 1, 1], [0, 1, 0], [1, 1, 0], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    want = [[1, 0, 1], [0, 0, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert passes_on(retrieval, range(5)).int().tolist() == want
    # skipped layers (a hybrid model's sliding ones) do not count: layer 0 then hands over to layer 2
    assert passes_on(retrieval, [0, 2, 3]).int().tolist() == [[0, 0, 1], [0] * 3, [1, 1, 0], [0] * 3, [0] * 3]
    policy = get_policy("lychee", budget=16, block_size=4)
    policy.bind(RoleManifest(ModelIdentity(5, 6, 3, 8), head_role=retrieval.to(torch.int8)), None)
    shape = type("Shape", (), {"layers": 5, "kv_heads": 3})()
    step = policy.static_step(shape)
    assert step.n_choosing == [2, 0, 2, 0, 0] and step.n_retrieval == [3, 1, 2, 0, 2]
    # per layer: the heads that choose, then the other retrieval heads, then the sparse ones
    assert [o.tolist() for o in step.head_order] == [[0, 2, 1], [1, 0, 2], [0, 1, 2], [0, 1, 2], [0, 2, 1]]


def test_the_recent_blocks_are_kept_when_they_outnumber_the_budget():
    """budget=2 with recent=4 (block size 1): the four last tokens are always kept, so the set holds those four
    and nothing else, however high another token scores; the engine's step reads sets of four blocks too."""
    from types import SimpleNamespace

    policy = get_policy("lychee", budget=2, recent=4)
    scores = torch.tensor([[[9.0, 8.0, 7.0, 0.0, 0.0, 0.0, 0.0, 0.0]]])
    chosen = policy._choose(scores, torch.ones(1, 1, 8, dtype=torch.bool))
    assert sorted(int(i) for i in chosen.flatten() if i >= 0) == [4, 5, 6, 7]
    policy.bind(RoleManifest(ModelIdentity(3, HQ, HKV, D), head_role=torch.tensor([[1, 1], [0, 1], [0, 0]],
                                                                                   dtype=torch.int8)), None)
    step = policy.static_step(SimpleNamespace(layers=3, kv_heads=HKV))
    assert (step.num_blocks, step.recent_blocks) == (4, 4)
