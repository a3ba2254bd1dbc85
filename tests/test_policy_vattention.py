"""vAttention: the observed relative error of head outputs stays within ε in at least 1 − δ of head-steps."""

import pytest
import torch

from runtime.kernels.sparse_attention import sparse_decode_attention
from runtime.policies import Step, get_policy

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
    from runtime import attach
    from runtime.models import load_model

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
    from runtime.manifest import ModelIdentity, RoleManifest

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
