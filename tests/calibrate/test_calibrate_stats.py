"""Closed forms for the per-row reductions and the sums-and-counts merge."""

from __future__ import annotations

import math

import pytest
import torch

from rolecall.calibrate.recorder import AttentionRecorder, record_traces
from rolecall.calibrate.stats import cosine_shift, hoyer_sparsity, page_sums, pair_recall, selected_pages
from rolecall.calibrate.totals import CalibrationTotals
from tests.tiny import tiny_model


def test_hoyer_closed_forms():
    n = 10
    assert hoyer_sparsity(torch.full((n,), 1 / n)).item() == pytest.approx(0.0, abs=1e-6)
    assert hoyer_sparsity(torch.eye(n)[3]).item() == pytest.approx(1.0, abs=1e-6)
    # p = (a, b, 0, ..., 0): l1 = a + b, l2 = sqrt(a² + b²)
    a, b = 0.7, 0.3
    p = torch.tensor([a, b] + [0.0] * (n - 2), dtype=torch.float64)
    want = (math.sqrt(n) - (a + b) / math.sqrt(a * a + b * b)) / (math.sqrt(n) - 1)
    assert hoyer_sparsity(p).item() == pytest.approx(want, rel=1e-12)
    # the row length counts, zero padding does not: pass n for a padded row
    padded = torch.nn.functional.pad(p, (0, 5))
    assert hoyer_sparsity(padded, torch.tensor(n)).item() == pytest.approx(want, rel=1e-12)
    assert hoyer_sparsity(padded).item() != pytest.approx(want, rel=1e-3)
    assert hoyer_sparsity(torch.ones(1)).item() == 0.0  # undefined for n = 1; defined as 0
    # batched over leading dims
    assert hoyer_sparsity(torch.stack([torch.full((n,), 0.1), torch.eye(n)[0]])).tolist() == pytest.approx([0, 1], abs=1e-6)


def test_hoyer_monte_carlo_of_dirichlet_rows_decreases_with_concentration():
    # Dirichlet(α) rows: small α → near one-hot (sparsity → 1), large α → near uniform (sparsity → 0)
    torch.manual_seed(0)
    means = []
    for alpha in (0.01, 1.0, 100.0):
        rows = torch.distributions.Dirichlet(torch.full((64,), alpha)).sample((2000,))
        means.append(hoyer_sparsity(rows).mean().item())
    assert means[0] > 0.9 and means[2] < 0.05 and means[0] > means[1] > means[2]


def test_cosine_shift_closed_forms():
    x = torch.tensor([0.2, 0.5, 0.3])
    assert cosine_shift(x, 3 * x).item() == pytest.approx(0.0, abs=1e-6)
    assert cosine_shift(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])).item() == pytest.approx(1.0)
    assert cosine_shift(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])).item() == pytest.approx(1 - 1 / math.sqrt(2))
    assert cosine_shift(torch.zeros(3), x).item() == 1.0
    assert cosine_shift(torch.eye(3), torch.eye(3)).tolist() == pytest.approx([0, 0, 0], abs=1e-6)


def test_pages_and_recall_by_hand():
    x = torch.arange(10.0)
    assert page_sums(x, 4).tolist() == [6.0, 22.0, 17.0]  # 0..3, 4..7, 8..9
    assert page_sums(x[:8], 4).tolist() == [6.0, 22.0]  # a length that fills its last page: ceil(8 / 4) = 2 pages
    score = torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 0.0]])  # query in page 5; page 6 does not exist yet
    keep = selected_pages(score, torch.tensor([5]), num_pages=4, recent_pages=2)
    assert keep.tolist() == [[True, False, True, False, True, True, False]]  # recent 4, 5; top-2 older 0, 2
    mass = torch.tensor([[[0.1, 0.2, 0.05, 0.25, 0.1, 0.3, 0.0]]])  # [L=1, Q=1, P]
    assert pair_recall(score[None], mass, torch.tensor([5]), 4, 2)[0, 0, 0].item() == pytest.approx(0.55)
    # a budget covering every page recalls everything
    assert pair_recall(score[None], mass, torch.tensor([5]), 6, 2)[0, 0, 0].item() == pytest.approx(1.0)


def _record(model, traces):
    rec = AttentionRecorder(3, 4, stride=5, min_context=10, page_size=4, num_pages=2, recent_pages=1, bins=4)
    return record_traces(model, traces, rec, chunk_size=32, progress=False)


def test_merging_two_halves_equals_one_pass():
    model = tiny_model("qwen3", layers=3, heads=4, kv_heads=2, seed=5)
    g = torch.Generator().manual_seed(6)
    traces = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 25, 51, 40)]
    whole = _record(model, traces)
    merged = _record(model, traces[:1]).merge(_record(model, traces[1:]))
    for key, value in whole.tensors().items():
        torch.testing.assert_close(merged.tensors()[key], value, rtol=1e-12, atol=1e-12, msg=key)
    # exact pooling differs from averaging the halves' means (the halves sample different query counts)
    a, b = _record(model, traces[:1]).means()["shift"], _record(model, traces[1:]).means()["shift"]
    assert not torch.allclose((a + b) / 2, whole.means()["shift"], atol=1e-6)
    assert whole.traces.item() == 4 and whole.tokens.item() == 186


def test_merge_refuses_other_shapes():
    with pytest.raises(ValueError, match="same model"):
        CalibrationTotals.zeros(3, 4, 2).merge(CalibrationTotals.zeros(4, 4, 2))


def test_a_bin_without_queries_gets_the_layers_overall_sparsity():
    """One layer, two heads, three bins. Bin 0: head sums 0.4 and 0.8 over 2 rows → 1.2 / (2 · 2) = 0.3; bin 1:
    1.0 and 1.4 over 3 rows → 2.4 / (3 · 2) = 0.4; bin 2 saw no query, so it takes the layer's overall mean
    (1.2 + 2.4) / (5 · 2) = 0.36, not 0."""
    t = CalibrationTotals.zeros(1, 2, 3)
    t.hoyer_sum[0, :, 0] = torch.tensor([0.4, 0.8], dtype=torch.float64)
    t.hoyer_sum[0, :, 1] = torch.tensor([1.0, 1.4], dtype=torch.float64)
    t.hoyer_count[0] = torch.tensor([2.0, 3.0, 0.0], dtype=torch.float64)
    means = t.means()
    assert means["sparsity"][0].tolist() == pytest.approx([0.3, 0.4, 0.36])
    assert means["layer_sparsity"].tolist() == pytest.approx([0.36])


@pytest.mark.parametrize("length, min_context, bins, positions, expected", [
    # span 64 in 8 bins of 8 positions: position 128 + 8k opens bin k, 128 + 8k − 1 closes bin k − 1
    (192, 128, 8, [128, 135, 136, 143, 144, 183, 184, 191], [0, 0, 1, 1, 2, 6, 7, 7]),
    # span 10 in 4 bins: floor(4 (p − 0) / 10): 0..2 → 0, 3..4 → 1, 5..7 → 2, 8..9 → 3
    (10, 0, 4, [0, 2, 3, 4, 5, 7, 8, 9], [0, 0, 1, 1, 2, 2, 3, 3]),
    # positions before min_context fall in bin 0; one bin takes everything
    (100, 50, 1, [0, 49, 50, 99], [0, 0, 0, 0]),
    # span 3 in 3 bins: one position each
    (8, 5, 3, [5, 6, 7], [0, 1, 2]),
])
def test_decode_time_bins_split_the_sampled_span_at_exact_fractions(length, min_context, bins, positions, expected):
    """A query at position p of a trace of ``length`` tokens falls in bin floor(bins · (p − min_context) / (length −
    min_context)): the bins are equal fractions of the sampled span, so a position exactly at a fraction opens the
    next bin."""
    rec = AttentionRecorder(1, 1, stride=1, min_context=min_context, bins=bins)
    rec.begin_trace(length)
    assert rec._bin(torch.tensor(positions)).tolist() == expected
