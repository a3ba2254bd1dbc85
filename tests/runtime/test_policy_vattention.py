"""vAttention: the observed relative error of head outputs stays within ε in at least 1 − δ of head-steps."""

import pytest
import torch

from rolecall.runtime.kernels.sparse_attention import sparse_decode_attention
from rolecall.runtime.policies import Step, get_policy

pytestmark = pytest.mark.usefixtures("one_thread")


def head_errors(policy, b=2, hkv=2, groups=4, t=8192, d=32, scale=1.0, trials=3, seed=0):
    # scale = standard deviation of the logits (q, k ~ N(0, I))
    """Relative errors [n] of every head output over a few random steps, and the fraction of tokens read."""
    torch.manual_seed(seed)
    errors, read, total = [], 0, 0
    for _ in range(trials):
        q = torch.randn(b, hkv * groups, d)
        k = torch.randn(b, hkv, t, d)
        v = torch.randn(b, hkv, t, d) * 0.5 + torch.randn(1, hkv, 1, d)  # values share a mean, as in real models
        keep = torch.ones(b, t, dtype=torch.bool)
        keep[-1, : t // 5] = False  # left padding
        plan = policy.plan(Step(0, q, k, v, keep, scale / d ** 0.5, {}))
        out, _ = sparse_decode_attention(q, k, v, plan.indices, scale=scale / d ** 0.5,
                                         log_weights=plan.log_weights, key_mask=keep)
        ref, _ = sparse_decode_attention(q, k, v, scale=scale / d ** 0.5, key_mask=keep)
        errors.append(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten())
        read += int((plan.indices >= 0).sum())
        total += int(keep.sum()) * hkv
    return torch.cat(errors), read / total


@pytest.mark.parametrize("epsilon,delta", [(0.1, 0.05), (0.2, 0.1)])
def test_error_bound_holds_on_random_attention(epsilon, delta):
    policy = get_policy("vattention", epsilon=epsilon, delta=delta, window=32, heavy=32)
    errors, fraction = head_errors(policy)
    assert float((errors <= epsilon).float().mean()) >= 1 - delta
    assert fraction < 0.9  # it does sample: fewer tokens than the context


def test_a_smaller_sample_than_the_bound_fails():
    # The CLT sample size matters: 1 % of it misses the bound in many head-steps (so the test can fail).
    policy = get_policy("vattention", epsilon=0.1, delta=0.05, window=32, heavy=32)
    exact = policy._sample_size

    def hundredth(*args):
        need = exact(*args)
        return torch.where(need >= args[-1], need, (need // 100).clamp_min(1))

    policy._sample_size = hundredth
    errors, _ = head_errors(policy, trials=1)
    assert float((errors <= 0.1).float().mean()) < 0.9


def test_tighter_epsilon_reads_more():
    loose, _ = head_errors(get_policy("vattention", epsilon=0.3, window=32, heavy=32), trials=1)
    tight_policy = get_policy("vattention", epsilon=0.05, window=32, heavy=32)
    _, tight_fraction = head_errors(tight_policy, trials=1)
    _, loose_fraction = head_errors(get_policy("vattention", epsilon=0.3, window=32, heavy=32), trials=1)
    assert tight_fraction > loose_fraction


def test_short_context_is_read_whole_and_exact():
    errors, fraction = head_errors(get_policy("vattention"), t=200, trials=1)
    assert fraction == 1.0 and float(errors.max()) < 1e-5


@pytest.mark.slow
def test_error_bound_holds_on_the_embedded_model():
    from rolecall.core.models import load_model
    from rolecall.runtime import attach

    model = load_model("smollm2-135m", dtype="float32")
    torch.manual_seed(0)
    ids = torch.randint(100, 20000, (1, 1024))
    epsilon, delta = 0.1, 0.05
    with attach(model, None, "vattention", epsilon=epsilon, delta=delta, window=64, heavy=64,
                record_error=True) as session:
        session.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    errors = torch.cat([torch.cat(e).flatten() for e in session.stats.error if e])
    assert errors.numel() == 3 * 30 * 9  # decode steps × layers × query heads
    assert float((errors <= epsilon).float().mean()) >= 1 - delta
    assert session.summary()["attended_fraction"] < 1.0


def test_heavy_hitters_follow_the_nearest_delta_layer():
    from rolecall.core.manifest import ModelIdentity, RoleManifest

    torch.manual_seed(4)
    b, hkv, g, t, d = 1, 2, 2, 600, 16
    manifest = RoleManifest(ModelIdentity(3, hkv * g, hkv, d), layer_role=torch.tensor([0, 1, 2], dtype=torch.int8))
    policy = get_policy("vattention", epsilon=0.5, delta=0.5, sinks=0, window=1, heavy=1, pilot=8)
    policy.bind(manifest, None)
    keep = torch.ones(b, t, dtype=torch.bool)
    q, k, v = torch.randn(b, hkv * g, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    assert policy.plan(Step(0, q, k, v, keep, 0.25, {})).indices is None  # full layers stay dense
    scratch = {}
    policy.plan(Step(1, q, k, v, keep, 0.25, scratch))
    published = scratch["vattention.scores"]  # [B, T]: max over all heads of the Δ-layer's probabilities
    probs = (torch.einsum("bhd,bhtd->bht", q, k.repeat_interleave(g, 1)) * 0.25).softmax(-1)
    assert torch.allclose(published, probs.amax(1), atol=1e-6)
    scratch["vattention.scores"] = torch.zeros(b, t)
    scratch["vattention.scores"][0, 123] = 1.0  # the Δ-layer says token 123 matters
    plan = policy.plan(Step(2, q, k, v, keep, 0.25, scratch))
    assert float(plan.log_weights.max()) > 0  # the rest is sampled, so 123 is there because it is a heavy hitter
    for h in range(hkv):
        where = (plan.indices[0, h] == 123).nonzero().flatten()
        assert where.numel() == 1 and float(plan.log_weights[0, h, where]) == 0.0  # deterministic, weight 1


def test_residual_slots_enumerate_the_free_slots_by_rank():
    """Brute force: the rank-th valid slot not in the deterministic set, for random sets with -1 padding."""
    from rolecall.runtime.policies.vattention import residual_slots

    g = torch.Generator().manual_seed(1)
    b, hkv, t = 3, 2, 50
    first = torch.tensor([0, 7, 20])
    fixed = torch.full((b, hkv, 9), -1)
    for i in range(b):
        for h in range(hkv):
            chosen = first[i] + torch.randperm(t - int(first[i]), generator=g)[:7]
            fixed[i, h, :7] = chosen[torch.randperm(7, generator=g)]  # any order, padding anywhere
    for i in range(b):
        for h in range(hkv):
            free = [s for s in range(int(first[i]), t) if s not in fixed[i, h].tolist()]
            ranks = torch.arange(len(free))
            got = residual_slots(ranks.expand(b, hkv, -1).contiguous(), fixed, first)[i, h]
            assert got.tolist() == free


def test_fixed_slots_hold_sinks_window_and_heavy_once():
    from rolecall.runtime.policies.vattention import fixed_slots, heavy_hitters

    first, last = torch.tensor([0, 10, 36]), torch.tensor(39)
    scores = torch.rand(3, 2, 40, generator=torch.Generator().manual_seed(2))
    heavy = heavy_hitters(scores, first, last, 2, 5, 4)
    fixed = fixed_slots(first, last, 2, 5, heavy)
    for i in range(3):
        for h in range(2):
            ids = [s for s in fixed[i, h].tolist() if s >= 0]
            assert len(ids) == len(set(ids)) and all(int(first[i]) <= s <= 39 for s in ids)
            valid = list(range(int(first[i]), 40))
            expect = set(valid[:2]) | set(range(35, 40))
            outside = [s for s in valid if s not in expect]
            best = sorted(outside, key=lambda s: -float(scores[i, h, s]))[:4]
            assert set(ids) == (expect & set(valid)) | set(best)


def test_draws_are_uniform_over_the_residual():
    """Monte Carlo over many steps: every draw lands in the residual, each residual slot about equally often."""
    from rolecall.runtime.policies.vattention import residual_slots, token_uniforms

    first = torch.tensor([3])
    fixed = torch.tensor([[[3, 4, 10, 11, 12, 29, -1]]])
    n_r = 30 - 3 - 6
    counts = torch.zeros(30)
    for tokens in range(400):
        u = token_uniforms(0, 1, tokens, 5, (1, 1, 50), "cpu")
        slots = residual_slots((u * n_r).long(), fixed, first).flatten()
        counts += torch.bincount(slots, minlength=30)[:30]
    assert counts[[0, 1, 2, 3, 4, 10, 11, 12, 29]].sum() == 0
    share = counts[counts > 0] / counts.sum()
    assert len(share) == n_r and float((share - 1 / n_r).abs().max()) < 0.2 / n_r  # 20000 draws: ±4.5 % sd


def test_fixed_slots_leave_out_sinks_past_the_last_slot():
    """Three valid slots (0..2) and four sinks: the sinks are slots 0, 1 and 2 and the fourth is absent (-1), not
    slot 3, which holds no token yet; the one-slot window (slot 2) is a sink already, so it is absent too."""
    from rolecall.runtime.policies.vattention import fixed_slots

    got = fixed_slots(torch.tensor([0]), torch.tensor(2), 4, 1, torch.full((1, 1, 0), -1))
    assert got.tolist() == [[[0, 1, 2, -1, -1]]]


def test_pilot_draws_reach_every_residual_slot_about_equally():
    """Slots 0..4 with slots 0 and 4 deterministic: the pilot draws from slots 1, 2 and 3, each about a third of
    3000 draws (±2.6 % at 3 sd), the last residual slot included."""
    policy = get_policy("vattention", pilot=3000)
    fixed = torch.tensor([[[0, 4]]])
    slots = policy.pilot_slots(torch.tensor([[3]]), fixed, torch.tensor([0]), 5, 0).flatten()
    counts = torch.bincount(slots, minlength=5)
    assert counts[[0, 4]].tolist() == [0, 0]
    share = counts[1:4].double() / 3000
    assert float((share - 1 / 3).abs().max()) < 0.026
