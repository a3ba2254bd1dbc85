import math

import pytest
import torch

from rolecall.train.distill import distill_loss, prefill, split_sample
from rolecall.train.hybrid import HybridAttention, budget_tokens, hybrid_layer
from tests.tiny import tiny_model

CASES = [("llama", 4, 1), ("qwen3", 4, 2), ("mistral", 4, 4)]


def _frozen(family, heads, kv, layers=3):
    model = tiny_model(family, layers=layers, heads=heads, kv_heads=kv)
    return model.requires_grad_(False)


def _sample(n=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n,), generator=g)
    labels = torch.full_like(ids, -100)
    labels[50:55] = ids[50:55]
    labels[60:64] = ids[60:64]
    return ids, labels


@pytest.mark.parametrize("family, heads, kv", CASES)
def test_all_retrieval_or_whole_budget_equals_the_teacher(family, heads, kv):
    model = _frozen(family, heads, kv)
    ids, labels = _sample()
    z_shape = (2, kv)
    for budget, z in ((0.3, torch.ones(z_shape)), (1.0, torch.zeros(z_shape)), (1.0, torch.rand(z_shape))):
        loss, seen = distill_loss(model, HybridAttention(3, budget), z, ids, labels, prefill_chunk=16)
        torch.testing.assert_close(seen["student logits"], seen["teacher logits"], atol=2e-5, rtol=1e-5)
        assert float(loss) < 1e-8
    # a small budget with sparse heads really changes the output
    loss, _ = distill_loss(model, HybridAttention(3, 0.1), torch.zeros(z_shape), ids, labels, prefill_chunk=16)
    assert float(loss) > 1e-3
    assert model.config._attn_implementation == "sdpa"


def test_loss_is_the_squared_logit_error_summed_over_the_vocabulary_and_averaged_over_targets():
    model = _frozen("llama", 4, 1)
    ids, labels = _sample()  # targets at 50..54 and 60..63: 9 of them, predicted by the logits at 49..53, 59..62
    loss, seen = distill_loss(model, HybridAttention(3, 0.1), torch.zeros(2, 1), ids, labels, prefill_chunk=16)
    with torch.no_grad():
        plain = model(input_ids=ids[None]).logits[0].float()  # the teacher is the model itself, one plain pass
    at = [49, 50, 51, 52, 53, 59, 60, 61, 62]
    torch.testing.assert_close(seen["teacher logits"][[p - 49 for p in at]], plain[at], atol=1e-4, rtol=1e-4)
    student = seen["student logits"][[p - 49 for p in at]]  # [9, V]
    want = sum(float(((student[i] - plain[p]) ** 2).sum()) for i, p in enumerate(at)) / 9
    assert want > 1e-3  # sparse heads at a small budget change the logits
    assert float(loss) == pytest.approx(want, rel=1e-4)


def _naive_layer(q, k, v, inherited, z, scaling):
    """Loop reference: q [Hq, S, D], k/v [Hkv, T, D] with queries at the last S positions; inherited [Hkv, S, T]."""
    hq, s, _ = q.shape
    hkv, t, _ = k.shape
    g = hq // hkv
    out = torch.zeros(s, hq, q.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kh = h // g
        for i in range(s):
            pos = t - s + i
            scores = [(q[h, i] @ k[kh, j]).item() * scaling for j in range(pos + 1)]
            full = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0) @ v[kh, : pos + 1].double()
            keep = [j for j in range(pos + 1) if inherited[kh, i, j]]
            sp = torch.softmax(torch.tensor([scores[j] for j in keep], dtype=torch.float64), 0) @ v[kh, keep].double()
            out[i, h] = z[kh] * full + (1 - z[kh]) * sp
    return out


def _naive_selection(q, k, scaling, top):
    """Per KV head and query: the ``top`` keys of the group-averaged causal attention probabilities."""
    hq, s, _ = q.shape
    hkv, t, _ = k.shape
    g = hq // hkv
    sel = torch.zeros(hkv, s, t, dtype=torch.bool)
    for kh in range(hkv):
        for i in range(s):
            pos = t - s + i
            probs = torch.stack([torch.softmax((k[kh, : pos + 1] @ q[h, i]) * scaling, 0) for h in range(kh * g, (kh + 1) * g)]).mean(0)
            for j in torch.argsort(probs, descending=True)[: min(top, pos + 1)].tolist():
                sel[kh, i, j] = True
    return sel


@pytest.mark.parametrize("hq, hkv", [(4, 1), (4, 2), (3, 3)])
def test_hybrid_layer_matches_a_loop_reference(hq, hkv):
    torch.manual_seed(3)
    s, t, d, top = 5, 11, 8, 4
    q1, q2 = torch.randn(1, hq, s, d) * 2, torch.randn(1, hq, s, d) * 2
    k1, k2 = torch.randn(1, hkv, t, d), torch.randn(1, hkv, t, d)
    v2 = torch.randn(1, hkv, t, d)
    keep = (torch.arange(t)[None, :] <= torch.arange(t - s, t)[:, None])[None, None]
    scaling = d**-0.5
    _, selected = hybrid_layer(q1, k1, k1, keep, scaling, None, None, top)
    assert torch.equal(selected[0], _naive_selection(q1[0], k1[0], scaling, top))
    z = torch.rand(hkv)
    out, _ = hybrid_layer(q2, k2, v2, keep, scaling, selected, z, top)  # [1, S, Hq, D]
    ref = _naive_layer(q2[0], k2[0], v2[0], selected[0], z.double(), scaling)
    torch.testing.assert_close(out[0].double(), ref, atol=1e-5, rtol=1e-5)


def test_gradient_matches_finite_differences_and_checkpointing_changes_nothing():
    model = _frozen("qwen3", 4, 2)
    ids, labels = _sample(seed=1)
    z = torch.full((2, 2), 0.5, dtype=torch.float32)
    grads = []
    for ckpt in (False, True):
        zz = z.clone().requires_grad_(True)
        loss, _ = distill_loss(model, HybridAttention(3, 0.2, checkpoint=ckpt), zz, ids, labels, prefill_chunk=20)
        loss.backward()
        grads.append((float(loss.detach()), zz.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-6, rtol=1e-5)
    eps = 1e-2
    for idx in [(0, 0), (1, 1)]:
        up, down = z.clone(), z.clone()
        up[idx] += eps
        down[idx] -= eps
        hyb = HybridAttention(3, 0.2)
        fd = (float(distill_loss(model, hyb, up, ids, labels, 20)[0]) - float(distill_loss(model, hyb, down, ids, labels, 20)[0])) / (2 * eps)
        assert fd == pytest.approx(float(grads[0][1][idx]), rel=2e-2, abs=1e-4)


def test_model_is_unchanged_after_training_forwards_and_after_errors():
    model = _frozen("llama", 4, 1)
    ids, labels = _sample()
    x = ids[None, :40]
    with torch.no_grad():
        before = model(x).logits
    distill_loss(model, HybridAttention(3, 0.3), torch.zeros(2, 1), ids, labels, prefill_chunk=16)
    with pytest.raises(ValueError, match="gates have shape"):
        distill_loss(model, HybridAttention(3, 0.3), torch.zeros(5, 1), ids, labels, prefill_chunk=16)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)


def test_prefill_in_chunks_equals_one_pass():
    model = _frozen("llama", 4, 2, layers=2)
    ids = torch.randint(0, 256, (1, 37))
    a, b = prefill(model, ids, 5), prefill(model, ids, 100)
    assert a.get_seq_length() == b.get_seq_length() == 37
    for la, lb in zip(a.layers, b.layers):
        torch.testing.assert_close(la.keys, lb.keys, atol=1e-5, rtol=1e-5)


def test_split_sample_and_budget():
    ids = torch.arange(10)
    labels = torch.full((10,), -100)
    labels[[5, 6, 8]] = ids[[5, 6, 8]]
    s = split_sample(ids, labels)
    assert s.prompt.tolist() == [[0, 1, 2, 3]] and s.span.tolist() == [[4, 5, 6, 7]]
    assert s.mask.tolist() == [True, True, False, True] and s.num_targets == 3
    with pytest.raises(ValueError, match="no target tokens"):
        split_sample(ids, torch.full((10,), -100))
    with pytest.raises(ValueError, match="same length"):
        split_sample(ids, labels[:5])
    assert budget_tokens(0.3, 1000) == 300 and budget_tokens(0.3, 7) == math.ceil(2.1)
    assert budget_tokens(64, 1000) == 64 and budget_tokens(64, 10) == 10 and budget_tokens(1.0, 9) == 9
    with pytest.raises(ValueError, match="token budget"):
        HybridAttention(3, 1.5)
    with pytest.raises(ValueError, match="token budget"):
        HybridAttention(3, 0)


def test_hybrid_layer_renormalises_exactly_when_the_selected_share_underflows():
    """Selected keys whose probabilities underflow in float32 (scores 200 below the best key) must still get
    the restricted softmax, not 0/0; the reference works in float64 from the scores."""
    torch.manual_seed(4)
    hq, hkv, s, t, d = 2, 1, 3, 8, 4
    q = torch.zeros(1, hq, s, d)
    q[..., 0] = 1.0
    k = torch.randn(1, hkv, t, d) * 0.1
    k[0, 0, 0, 0] = 200.0  # key 0 dominates every query
    v = torch.randn(1, hkv, t, d)
    keep = (torch.arange(t)[None, :] <= torch.arange(t - s, t)[:, None])[None, None]
    inherited = torch.zeros(1, hkv, s, t, dtype=torch.bool)
    inherited[..., 2:4] = True  # never key 0
    z = torch.tensor([0.25])
    out, _ = hybrid_layer(q, k, v, keep, 1.0, inherited, z, 2)
    ref = _naive_layer(q[0], k[0], v[0], inherited[0], z.double(), 1.0)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out[0].double(), ref, atol=1e-5, rtol=1e-5)


def test_hybrid_layer_gradients_match_the_float64_reference():
    """Gradients with respect to queries, keys, values and z of the one-softmax form equal those of the
    two-softmax definition, computed in float64."""
    torch.manual_seed(5)
    hq, hkv, s, t, d = 4, 2, 4, 9, 8
    q, k, v = (torch.randn(1, h, n, d, dtype=torch.float64) for h, n in ((hq, s), (hkv, t), (hkv, t)))
    keep = (torch.arange(t)[None, :] <= torch.arange(t - s, t)[:, None])[None, None]
    inherited = torch.rand(1, hkv, s, t) < 0.5
    inherited[..., -1] = True
    z = torch.rand(hkv, dtype=torch.float64)

    grads = _gradients([lambda *a: hybrid_layer(*a[:3], keep, d**-0.5, inherited, a[3], 3)[0],
                        lambda *a: _two_softmax(*a, keep, inherited, d**-0.5)], (q, k, v, z))
    for mine, ref in zip(*grads):
        torch.testing.assert_close(mine.double(), ref, atol=2e-5, rtol=1e-4)


def _two_softmax(q, k, v, z, keep, inherited, scaling):
    """The definition, two softmaxes in float64: z · softmax over ``keep`` + (1 − z) · softmax over the inherited
    keys within it (every row reads at least one); [B, S, Hq, D]."""
    g = q.shape[1] // k.shape[1]
    kr, vr = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    sc = q.double() @ kr.transpose(-1, -2) * scaling
    full = torch.softmax(sc.masked_fill(~keep, float("-inf")), -1) @ vr
    sparse = torch.softmax(sc.masked_fill(~(inherited.repeat_interleave(g, 1) & keep), float("-inf")), -1) @ vr
    zq = z.double().repeat_interleave(g)[None, :, None, None]
    return (zq * full + (1 - zq) * sparse).transpose(1, 2)


def _gradients(functions, inputs):
    """For each function of ``inputs``: the gradients of a fixed weighted sum of its output."""
    grads = []
    for fn in functions:
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        out = fn(*leaves)
        (out.double() * torch.linspace(-1, 1, out.numel(), dtype=torch.float64, device=out.device).view_as(out)).sum().backward()
        grads.append([x.grad for x in leaves])
    return grads


# The fused kernels (rolecall.train.hybrid_kernel) run here in Triton's CPU interpreter (tests/conftest.py sets
# TRITON_INTERPRET=1 without a GPU), against the same references as the PyTorch layer.

def _interpreted():
    import os

    if torch.cuda.is_available():
        pytest.skip("the GPU tests cover the kernels")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU")
    from rolecall.train.hybrid import hybrid_layer_fused

    return hybrid_layer_fused


@pytest.mark.parametrize("hq, hkv", [(4, 1), (4, 2), (3, 3)])
def test_fused_layer_matches_the_loop_reference(hq, hkv):
    """Outputs against the loop over heads and queries; the next layer's set against the group-averaged
    probabilities' top keys, one query at a time."""
    fused = _interpreted()
    torch.manual_seed(3)
    s, t, d, top = 5, 11, 8, 4
    q1, q2 = torch.randn(1, hq, s, d) * 2, torch.randn(1, hq, s, d) * 2
    k1, k2, v2 = torch.randn(1, hkv, t, d), torch.randn(1, hkv, t, d), torch.randn(1, hkv, t, d)
    keep = (torch.arange(t)[None, :] <= torch.arange(t - s, t)[:, None])[None, None]
    _, selected = fused(q1, k1, k1, keep, d**-0.5, None, None, top)
    assert torch.equal(selected[0], _naive_selection(q1[0], k1[0], d**-0.5, top))
    z = torch.rand(hkv)
    out, _ = fused(q2, k2, v2, keep, d**-0.5, selected, z, top)
    torch.testing.assert_close(out[0].double(), _naive_layer(q2[0], k2[0], v2[0], selected[0], z.double(), d**-0.5),
                               atol=1e-5, rtol=1e-5)


def test_fused_gradients_match_the_float64_definition():
    """∂/∂(q, k, v, z) from the kernels' backward pass (a batch of two, a head size that is not a power of two,
    GQA groups of three) against autograd through the two-softmax definition in float64."""
    fused = _interpreted()
    torch.manual_seed(6)
    b, hq, hkv, s, t, d = 2, 6, 2, 7, 19, 12
    q, k, v = torch.randn(b, hq, s, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    keep = (torch.arange(t)[None, :] <= torch.arange(t - s, t)[:, None])[None, None]
    inherited = torch.rand(b, hkv, s, t) < 0.4
    inherited[..., 0] = True
    z = torch.rand(hkv)
    grads = _gradients([lambda *a: fused(*a[:3], keep, d**-0.5, inherited, a[3], 5)[0],
                        lambda *a: _two_softmax(*a, keep, inherited, d**-0.5)], (q, k, v, z))
    for mine, ref in zip(*grads):
        torch.testing.assert_close(mine.double(), ref.double(), atol=1e-5, rtol=1e-4)


def test_fused_layer_agrees_with_the_layer_under_a_window_and_an_underflowing_set():
    """A sliding window that hides every inherited key of some queries (they read their own position), and
    selected keys 200 below the best one (the sparse softmax exact, not 0/0): outputs, sets and gradients equal
    the PyTorch layer's."""
    fused = _interpreted()
    torch.manual_seed(7)
    hq, hkv, s, t, d = 4, 2, 9, 24, 16
    q, k, v = torch.randn(1, hq, s, d), torch.randn(1, hkv, t, d), torch.randn(1, hkv, t, d)
    k[0, 0, 0] = q[0, 0, 0] * 60  # key 0 dominates the first group's queries
    pos = torch.arange(t - s, t)[:, None]
    keep = ((torch.arange(t)[None, :] <= pos) & (torch.arange(t)[None, :] > pos - 6))[None, None]
    inherited = torch.zeros(1, hkv, s, t, dtype=torch.bool)
    inherited[..., 1:12] = True  # hidden by the window from the later queries
    z = torch.tensor([0.3, 0.8])
    outs = [fn(q, k, v, keep, d**-0.5, inherited, z, 3) for fn in (hybrid_layer, fused)]
    assert bool(torch.isfinite(outs[1][0]).all())
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-4)
    assert torch.equal(outs[1][1], outs[0][1])
    grads = _gradients([lambda *a, fn=fn: fn(*a[:3], keep, d**-0.5, inherited, a[3], 3)[0] for fn in (hybrid_layer, fused)],
                       (q, k, v, z))
    for mine, ref in zip(grads[1], grads[0]):
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_fused_layer_in_bf16_on_gpu_matches_the_float32_layer():
    """An 8B-shaped layer (32 query heads over 8, head size 128) at 200 queries over 3,000 keys in bf16: outputs
    and gradients within bf16's precision of the float32 PyTorch layer's, most of the next layer's set equal
    (bf16 scores may swap keys of near-equal probability)."""
    from rolecall.train.hybrid import hybrid_layer_fused

    torch.manual_seed(8)
    hq, hkv, s, t, d = 32, 8, 200, 3000, 128
    q, k, v = (torch.randn(1, h, n, d, device="cuda") for h, n in ((hq, s), (hkv, t), (hkv, t)))
    keep = (torch.arange(t, device="cuda")[None, :] <= torch.arange(t - s, t, device="cuda")[:, None])[None, None]
    inherited = torch.rand(1, hkv, s, t, device="cuda") < 0.3
    z = torch.rand(hkv, device="cuda")
    outs = [fn(*(x.bfloat16() for x in (q, k, v)), keep, d**-0.5, inherited, z, 900)
            for fn in (hybrid_layer, hybrid_layer_fused)]
    torch.testing.assert_close(outs[1][0].float(), outs[0][0].float(), atol=2e-2, rtol=2e-2)
    assert (outs[1][1] == outs[0][1]).float().mean() > 0.99
    grads = _gradients([lambda *a, fn=fn: fn(*(x.bfloat16() for x in a[:3]), keep, d**-0.5, inherited, a[3], 900)[0]
                        for fn in (hybrid_layer, hybrid_layer_fused)], (q, k, v, z))
    for mine, ref in zip(grads[1], grads[0]):
        scale = ref.abs().max()
        assert float((mine - ref).abs().max() / scale) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("family, heads, kv", CASES)
def test_fused_distillation_loss_and_gate_gradients_equal_the_reference_on_gpu(family, heads, kv):
    """A whole student forward and backward on a tiny model: the loss and ∂loss/∂z through the kernels equal
    those through the PyTorch layer (float32 weights; the kernels' products take TF32)."""
    model = _frozen(family, heads, kv).cuda()
    ids, labels = _sample(seed=2)
    results = []
    for fused in (False, True):
        z = torch.full((2, kv), 0.4, device="cuda").requires_grad_(True)
        loss, _ = distill_loss(model, HybridAttention(3, 0.3, fused=fused), z, ids, labels, prefill_chunk=20)
        loss.backward()
        results.append((float(loss.detach()), z.grad.clone()))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-2)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-3, rtol=2e-2)
