"""The recorder against a brute-force computation from eager attention probabilities."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rolecall.calibrate.recorder import AttentionRecorder, record_traces
from tests.tiny import tiny_model

PAGE, TOP, RECENT, STRIDE, MIN_CTX, BINS = 4, 5, 2, 7, 20, 3  # TOP = K pages in all, RECENT of them


def brute_force(model, ids: list[int]) -> dict[str, np.ndarray]:
    """Every statistic from the full [Hq, T, T] eager probabilities, with plain numpy loops."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(torch.tensor([ids]), output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    att = [x[0].double().numpy() for x in att]  # L × [Hq, T, T]
    n_layers, heads, length = len(att), att[0].shape[0], len(ids)
    positions = list(range(MIN_CTX, length, STRIDE))
    out = {k: np.zeros(s) for k, s in [("shift", n_layers), ("drift", n_layers), ("hoyer", (n_layers, heads, BINS)),
                                        ("hoyer_count", (n_layers, BINS)), ("recall", (n_layers, n_layers))]}

    def cos(x, y):
        m = max(len(x), len(y))
        x, y = np.pad(x, (0, m - len(x))), np.pad(y, (0, m - len(y)))
        return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))

    for j, t in enumerate(positions):
        b = min((t - MIN_CTX) * BINS // (length - MIN_CTX), BINS - 1)
        a = [att[layer][:, t, : t + 1].max(0) for layer in range(n_layers)]
        npages = -(-(t + 1) // PAGE)
        for layer in range(n_layers):
            p = att[layer][:, t, : t + 1]
            for h in range(heads):
                r = np.sqrt(t + 1)
                out["hoyer"][layer, h, b] += (r - p[h].sum() / np.sqrt((p[h] ** 2).sum())) / (r - 1)
            out["hoyer_count"][layer, b] += 1
            if layer:
                out["shift"][layer] += 1 - cos(a[layer - 1], a[layer])
            if j:
                prev = att[layer][:, positions[j - 1], : positions[j - 1] + 1].max(0)
                out["drift"][layer] += cos(prev, a[layer])
        for s in range(n_layers):
            score = [a[s][u * PAGE : (u + 1) * PAGE].sum() for u in range(npages)]
            recent = set(range(max(0, npages - RECENT), npages))
            older = sorted((u for u in range(npages) if u not in recent), key=lambda u: -score[u])
            chosen = recent | set(older[: TOP - RECENT])
            for layer in range(n_layers):
                mass = att[layer][:, t, : t + 1].mean(0)
                out["recall"][s, layer] += sum(mass[u * PAGE : (u + 1) * PAGE].sum() for u in chosen)
    out["samples"] = len(positions)
    return out


@pytest.mark.parametrize("family,heads,kv_heads,chunk", [("llama", 4, 2, 1000), ("qwen2", 6, 2, 23)])
def test_recorder_matches_eager_brute_force(family, heads, kv_heads, chunk):
    model = tiny_model(family, layers=3, heads=heads, kv_heads=kv_heads, seed=1)
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = brute_force(model, ids)
    rec = AttentionRecorder(3, heads, stride=STRIDE, min_context=MIN_CTX, page_size=PAGE, num_pages=TOP,
                            recent_pages=RECENT, bins=BINS, query_block=3)
    tot = record_traces(model, [ids], rec, chunk_size=chunk, progress=False)
    q = ref["samples"]
    assert q == 10 and tot.recall_count.item() == q and tot.traces.item() == 1 and tot.tokens.item() == 90
    np.testing.assert_allclose(tot.shift_count.numpy(), [0, q, q])
    np.testing.assert_allclose(tot.shift_sum.numpy(), ref["shift"], atol=1e-5)
    np.testing.assert_allclose(tot.drift_count.numpy(), [q - 1] * 3)
    np.testing.assert_allclose(tot.drift_sum.numpy(), ref["drift"], atol=1e-5)
    np.testing.assert_allclose(tot.hoyer_count.numpy(), ref["hoyer_count"])
    np.testing.assert_allclose(tot.hoyer_sum.numpy(), ref["hoyer"], atol=1e-5)
    np.testing.assert_allclose(tot.recall_sum.numpy(), ref["recall"], atol=1e-5)
    # the statistics are not trivial: attention differs between layers and is far from uniform
    assert ref["shift"][1:].min() > 0.01 * q and ref["hoyer"].sum() > 0.05 * q * 3 * heads
    assert (ref["recall"] < q - 1e-3).any()


def test_outputs_unchanged_while_recording_and_restored_after():
    model = tiny_model("qwen2", layers=2, heads=4, kv_heads=1, seed=3)
    x = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(x).logits
    rec = AttentionRecorder(2, 4, stride=5, min_context=4, page_size=4, num_pages=2, recent_pages=1)
    rec.begin_trace(40)
    with rec.attached(model), torch.no_grad():
        assert model.config._attn_implementation == "rolecall-record"
        during = model(x).logits
        rec.flush()
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        after = model(x).logits
    torch.testing.assert_close(during, before, rtol=0, atol=0)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert rec.totals.recall_count.item() == 8  # positions 4, 9, ..., 39


def test_recorder_restores_attention_when_the_forward_raises():
    model = tiny_model("llama", layers=2, heads=2, kv_heads=1)
    rec = AttentionRecorder(2, 2)
    with pytest.raises(ValueError, match="one trace per forward"), rec.attached(model), torch.no_grad():
        model(torch.zeros(2, 200, dtype=torch.long))
    assert model.config._attn_implementation == "sdpa"


def test_k_equal_to_l_reads_only_the_recent_pages_and_k_below_l_is_refused():
    """K counts the L recent pages, so K = L is the documented lower end: every page read is a recent one. With
    K = L = 1 each sampled query keeps only its own page, whatever layer selects, so every row of the recall
    matrix equals the head-mean attention mass on the query's page, summed by hand from eager probabilities.
    K = L − 1 is refused."""
    with pytest.raises(ValueError, match="num_pages ≥ recent_pages"):
        AttentionRecorder(2, 4, num_pages=1, recent_pages=2)
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, seed=7)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    rec = AttentionRecorder(2, 4, stride=6, min_context=10, page_size=4, num_pages=1, recent_pages=1, bins=2)
    tot = record_traces(model, [ids], rec, chunk_size=1000, progress=False)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(torch.tensor([ids]), output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    positions = list(range(10, 40, 6))
    want = [sum(float(att[layer][0, :, t, (t // 4) * 4 : t + 1].mean(0).sum()) for t in positions) for layer in (0, 1)]
    assert tot.recall_count.item() == len(positions) == 5
    np.testing.assert_allclose(tot.recall_sum.numpy(), [want, want], atol=1e-5)
    assert max(want) < len(positions) - 0.1  # the pages left out hold mass: the check is not trivial
