"""Calibration's counts, choices and sums at their exact ends, worked by hand: pages when the page size divides
the keys, sampled queries whose first or last position falls exactly on a chunk's edge, a peak exactly
``min_gap`` layers after the warm-up, the warm-up mapped onto candidate layers, ties between equally good
Δ-layers, selectors that never reach their target, Lethe budgets of layers with no density, per-layer means of
empty counts and traces cut at their first EOS."""

from __future__ import annotations

import pytest
import torch

from rolecall.calibrate.delta import (
    check_delta_count,
    choose_delta_layers,
    get_selector,
    layer_roles,
    mean_sparse_recall,
    recall_per_layer,
    select_among,
)
from rolecall.calibrate.lethe import LetheBudget
from rolecall.calibrate.recorder import AttentionRecorder
from rolecall.calibrate.stats import page_sums
from rolecall.calibrate.totals import CalibrationTotals
from rolecall.calibrate.traces import _answer, read_traces


# -- page sums ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keys, page, sums", [
    (1, 1, [1.0]), (1, 4, [1.0]), (3, 4, [3.0]), (4, 4, [4.0]), (5, 4, [4.0, 1.0]),
    (8, 4, [4.0, 4.0]), (9, 4, [4.0, 4.0, 1.0]), (4, 1, [1.0, 1.0, 1.0, 1.0]), (16, 16, [16.0]), (17, 16, [16.0, 1.0]),
])
def test_page_sums_make_ceil_keys_over_page_pages_with_a_partial_last_one(keys, page, sums):
    """Ones over ``keys`` keys: every full page sums to ``page``, the last one to what is left; a page size that
    divides the keys leaves no empty page behind."""
    assert page_sums(torch.ones(keys), page).tolist() == sums
    assert page_sums(torch.ones(2, keys), page).tolist() == [sums, sums]  # leading dimensions broadcast


# -- sampled query positions -------------------------------------------------------------------------------------------
def _sampled_by_hand(start: int, end: int, length: int, min_context: int, stride: int) -> list[int]:
    return [t for t in range(start, min(end, length)) if t >= min_context and (t - min_context) % stride == 0]


@pytest.mark.parametrize("min_context, stride, length, start, end", [
    (10, 4, 40, 0, 40),  # a whole trace: 10, 14, ..., 38
    (10, 4, 40, 10, 20),  # a chunk that starts exactly on a sampled position takes it
    (10, 4, 40, 11, 20),  # one past it: the next one, 14
    (10, 4, 40, 14, 18),  # an end exactly on a sampled position (18) leaves it to the next chunk
    (10, 4, 40, 14, 19),  # one past: 18 is in
    (10, 4, 40, 0, 10),  # the chunk ends where sampling begins: nothing
    (10, 4, 40, 0, 11),  # ... one more token: min_context itself
    (10, 4, 39, 30, 100),  # the trace ends before the chunk: 30, 34, 38 is the last (length 39 holds 0..38)
    (10, 4, 38, 30, 100),  # length 38: 38 does not exist
    (0, 1, 5, 0, 5),  # every position
    (0, 7, 7, 0, 7),  # a stride as long as the trace: position 0 only
    (5, 3, 6, 0, 6),  # one sampled position, the last token
])
def test_sampled_positions_in_a_chunk_at_its_edges(min_context, stride, length, start, end):
    """Queries sampled in ``[start, end)`` of a trace of ``length`` tokens: every ``stride``-th position from
    ``min_context`` on, the start inclusive and the end exclusive, never past the trace."""
    rec = AttentionRecorder(1, 1, stride=stride, min_context=min_context, page_size=4, num_pages=2, recent_pages=1)
    rec.begin_trace(length)
    want = _sampled_by_hand(start, end, length, min_context, stride)
    assert rec.sampled_positions(start, end) == want


def test_sampled_positions_worked_by_hand():
    rec = AttentionRecorder(1, 1, stride=4, min_context=10, page_size=4, num_pages=2, recent_pages=1)
    rec.begin_trace(39)
    assert rec.sampled_positions(0, 100) == [10, 14, 18, 22, 26, 30, 34, 38]
    assert rec.sampled_positions(11, 18) == [14]
    assert rec.sampled_positions(18, 18) == []


# -- Δ-layer counts and peaks ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers, num_delta, warmup, ok", [
    (6, 4, 2, True), (6, 5, 2, False), (6, 1, 2, True), (6, 0, 2, False),
    (6, 1, 5, True), (6, 1, 6, False), (6, 6, 0, True), (6, 7, 0, False), (1, 1, 0, True), (6, 1, -1, False),
])
def test_delta_count_at_the_ends_of_its_ranges(layers, num_delta, warmup, ok):
    """warm-up in [0, L − 1] and num_delta in [1, L − warm-up]: the last layer may be the only Δ-layer, and every
    layer from the warm-up on may be one."""
    if ok:
        check_delta_count(layers, num_delta, warmup)
    else:
        with pytest.raises(ValueError):
            check_delta_count(layers, num_delta, warmup)


@pytest.mark.parametrize("peaks, num_delta, warmup, min_gap, chosen", [
    # a peak exactly min_gap after the warm-up Δ-layer is far enough; one layer closer is not
    ({5: 1.0}, 2, 2, 3, [2, 5]),
    ({4: 1.0, 8: 0.5}, 2, 2, 3, [2, 8]),
    # two peaks exactly min_gap apart are both taken
    ({5: 1.0, 8: 0.9}, 3, 2, 3, [2, 5, 8]),
    # the last layer is a peak of its own (the curve is padded past its end)
    ({9: 1.0}, 2, 2, 3, [2, 9]),
    ({5: 1.0, 6: 0.9, 9: 0.5}, 3, 2, 1, [2, 5, 9]),  # 9 is a peak, 6 (higher) is not
    # equal heights: the earlier layer first
    ({5: 0.7, 9: 0.7}, 2, 2, 3, [2, 5]),
    ({4: 0.7, 8: 0.7}, 2, 0, 3, [0, 4]),
    # warm-up at the last layer: it is the only candidate
    ({}, 1, 9, 3, [9]),
    # every layer from the warm-up on, gap or no gap
    ({5: 1.0}, 8, 2, 3, [2, 3, 4, 5, 6, 7, 8, 9]),
])
def test_delta_layers_at_the_gap_and_tie_ends(peaks, num_delta, warmup, min_gap, chosen):
    """Ten layers on a flat curve of 0.1 with peaks; a peak counts when it is at least ``min_gap`` layers from
    every Δ-layer already taken (distance = min_gap is enough), higher peaks first, ties to the shallower layer."""
    curve = [0.1] * 10
    for layer, height in peaks.items():
        curve[layer] = height
    assert choose_delta_layers(curve, num_delta, warmup, min_gap) == chosen


# -- selectors ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["peaks", "recall"])
def test_auto_takes_every_layer_when_the_target_is_never_reached(name):
    """Pairs that recall nothing: no set with a sparse layer reaches 0.9, so ``auto`` ends with every layer from
    the warm-up on (recall of the sparse layers is then 1.0 by definition)."""
    recall = torch.zeros(6, 6, dtype=torch.float64)
    got = get_selector(name, warmup=1, min_gap=1, target_recall=0.9)(torch.zeros(6), recall, "auto")
    assert got == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("count, chosen", [(1, [2]), (2, [2, 3]), (3, [2, 3, 4]), (6, [2, 3, 4, 5, 6, 7])])
def test_recall_selector_breaks_ties_towards_the_shallower_layer(count, chosen):
    """Every pair recalls 0.5: each added layer raises the mean alike, so the greedy search takes the shallowest."""
    recall = torch.full((8, 8), 0.5, dtype=torch.float64)
    assert get_selector("recall", warmup=2)(torch.zeros(8), recall, count) == chosen


@pytest.mark.parametrize("candidates, warmup, chosen", [
    # warm-up 2 over candidates 0, 2, 3, ...: one candidate (0) lies below layer 2, so layer 2 is the first Δ-layer
    ([0, 2, 3, 5, 6, 7], 2, [2]),
    # warm-up 3: candidates 0 and 2 lie below it, the first at or after it is 3
    ([0, 2, 3, 5, 6, 7], 3, [3]),
    # warm-up 4: none is 4, so the first candidate after it, 5
    ([0, 2, 3, 5, 6, 7], 4, [5]),
    # warm-up 0: the first candidate whatever its index
    ([1, 3, 5], 0, [1]),
])
def test_select_among_maps_the_warmup_onto_the_candidates(candidates, warmup, chosen):
    """The selector's warm-up counts layers; on the candidate layers it becomes the number of candidates strictly
    below it, so the first candidate at or after ``warmup`` is the first Δ-layer."""
    selector = get_selector("peaks", warmup=warmup, min_gap=1)
    assert select_among(selector, torch.zeros(8), torch.zeros(8, 8), 1, candidates) == chosen


@pytest.mark.parametrize("candidates, warmup, refused", [([0, 2, 3], 3, False), ([0, 2, 3], 4, True), ([5], 5, False)])
def test_select_among_refuses_a_warmup_past_the_last_candidate(candidates, warmup, refused):
    selector = get_selector("peaks", warmup=warmup, min_gap=1)
    if refused:
        with pytest.raises(ValueError, match="leaves no full-attention layer"):
            select_among(selector, torch.zeros(8), torch.zeros(8, 8), 1, candidates)
    else:
        assert select_among(selector, torch.zeros(8), torch.zeros(8, 8), 1, candidates) == [candidates[-1]]


@pytest.mark.parametrize("name, settings, ok", [
    ("peaks", {"warmup": 0, "min_gap": 1, "target_recall": 1.0}, True),
    ("peaks", {"warmup": -1}, False), ("peaks", {"min_gap": 0}, False), ("peaks", {"target_recall": 0.0}, False),
    ("peaks", {"target_recall": 1.0 + 1e-9}, False),
    ("recall", {"warmup": 0, "target_recall": 1.0}, True), ("recall", {"min_gap": 0}, True),  # min_gap unused
    ("recall", {"warmup": -1}, False), ("recall", {"target_recall": 0.0}, False),
])
def test_selector_settings_at_their_range_ends(name, settings, ok):
    if ok:
        assert get_selector(name, **settings).warmup == settings.get("warmup", 2)
    else:
        with pytest.raises(ValueError, match=f"{name} selector needs"):
            get_selector(name, **settings)


@pytest.mark.parametrize("given, taken", [("1", 1), ("12", 12), (1, 1), ("auto", "auto")])
def test_a_num_delta_of_digits_is_a_count(given, taken):
    from rolecall.calibrate.config import CalibrateConfig

    assert CalibrateConfig(num_delta=given).num_delta == taken


@pytest.mark.parametrize("given", ["0", 0, "-1", "1.5", "Auto"])
def test_a_num_delta_below_one_or_not_a_count_is_refused(given):
    from rolecall.calibrate.config import CalibrateConfig
    from rolecall.core.configfile import ConfigError

    with pytest.raises(ConfigError, match="num_delta must be an integer ≥ 1 or 'auto'"):
        CalibrateConfig(num_delta=given)


# -- roles and recall per layer ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers, delta, warmup, sliding, roles", [
    (4, [0], 0, (), [1, 2, 2, 2]),
    (4, [3], 3, (), [0, 0, 0, 1]),
    (5, [2, 3, 4], 2, (), [0, 0, 1, 1, 1]),
    (6, [2, 5], 2, (3,), [0, 0, 1, 0, 2, 1]),
    (1, [0], 0, (), [1]),
    (4, [3], 2, (), [0, 0, 2, 1]),  # only [0, warmup) is full, whatever the Δ set
])
def test_layer_roles_at_the_ends(layers, delta, warmup, sliding, roles):
    assert layer_roles(layers, delta, warmup, sliding).tolist() == roles


@pytest.mark.parametrize("delta, per_layer", [
    # recall[s, l] = (10 s + l) / 100; each sparse layer reads its nearest earlier Δ-layer
    ([1], [1, 1, 0.12, 0.13, 0.14, 0.15]),
    ([1, 2], [1, 1, 1, 0.23, 0.24, 0.25]),
    ([1, 4], [1, 1, 0.12, 0.13, 1, 0.45]),
    ([1, 5], [1, 1, 0.12, 0.13, 0.14, 1]),
    ([1, 2, 3, 4, 5], [1, 1, 1, 1, 1, 1]),
])
def test_recall_per_layer_reads_the_nearest_earlier_delta_layer(delta, per_layer):
    recall = torch.tensor([[(10 * s + t) / 100 for t in range(6)] for s in range(6)], dtype=torch.float64)
    assert recall_per_layer(recall, delta, 1).tolist() == pytest.approx(per_layer)
    sparse = [x for i, x in enumerate(per_layer) if i >= 1 and i not in delta]
    want = sum(sparse) / len(sparse) if sparse else 1.0
    assert mean_sparse_recall(recall, delta, 1) == pytest.approx(want)


# -- Lethe budgets -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sparsity, budget, floor, expected", [
    # no layer has any density: every layer gets the mean budget
    ([1.0, 1.0, 1.0], 0.3, 0.02, [0.3, 0.3, 0.3]),
    # sparsity above 1 is no density either (clamped at 0)
    ([1.2, 1.0], 0.5, 0.0, [0.5, 0.5]),
    # ... and does not cancel another layer's density: c · 0.5 = 2 · 0.4
    ([1.5, 0.5], 0.4, 0.0, [0.0, 0.8]),
    # a floor equal to the budget: every layer sits at it
    ([0.9, 0.0, 0.5], 0.2, 0.2, [0.2, 0.2, 0.2]),
    # one dense layer of two, floor 0: c · 1 = 2 · 0.4 keeps 0.8 there and nothing where density is 0
    ([1.0, 0.0], 0.4, 0.0, [0.0, 0.8]),
    # one dense layer of two with a floor: (0.1 + c) / 2 = 0.4 gives c = 0.7
    ([1.0, 0.0], 0.4, 0.1, [0.1, 0.7]),
])
def test_lethe_budgets_where_layers_have_no_density(sparsity, budget, floor, expected):
    got = LetheBudget(budget=budget, min_budget=floor)(torch.tensor(sparsity))
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=0)


# -- totals ------------------------------------------------------------------------------------------------------------
def test_means_of_empty_counts_are_zero_and_of_one_count_the_sum():
    """A mean over a count of 0 is 0 (nothing recorded), over a count of 1 the sum itself."""
    t = CalibrationTotals.zeros(2, 1, 2)
    t.shift_sum[1], t.shift_count[1] = 0.25, 1
    t.drift_sum[:] = torch.tensor([0.6, 0.9], dtype=torch.float64)
    t.drift_count[:] = torch.tensor([2.0, 3.0], dtype=torch.float64)
    t.position_sum[0], t.position_count[0] = 300.0, 2
    t.recall_sum[:] = torch.tensor([[1.5, 1.0], [0.5, 1.5]], dtype=torch.float64)
    means = t.means()
    assert means["shift"].tolist() == [0.0, 0.25]
    assert means["drift"].tolist() == pytest.approx([0.3, 0.3])
    assert means["positions"].tolist() == [150.0, 0.0]
    assert means["recall"].tolist() == [[1.5, 1.0], [0.5, 1.5]]  # recall_count 0: the sums unchanged
    t.recall_count += 2
    assert t.means()["recall"].tolist() == [[0.75, 0.5], [0.25, 0.75]]


@pytest.mark.parametrize("layers, heads, bins, ok", [(1, 1, 1, True), (0, 1, 1, False), (1, 0, 1, False),
                                                     (1, 1, 0, False)])
def test_totals_need_one_layer_head_and_bin(layers, heads, bins, ok):
    if ok:
        assert CalibrationTotals.zeros(layers, heads, bins).hoyer_sum.shape == (1, 1, 1)
    else:
        with pytest.raises(ValueError, match="must be ≥ 1"):
            CalibrationTotals.zeros(layers, heads, bins)


# -- traces ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("row, trace", [
    ([5, 6, 2, 7], [1, 5, 6, 2]),  # up to and with the first EOS
    ([2, 5, 2], [1, 2]),  # an EOS first: the answer is that one token
    ([5, 6, 7], [1, 5, 6, 7]),  # no EOS: everything generated
    ([5, 6, 3], [1, 5, 6, 3]),  # the last token is the EOS
    ([], [1]),
])
def test_a_trace_ends_at_its_first_eos(row, trace):
    assert _answer([1], row, {2, 3}) == trace


@pytest.mark.parametrize("lines, traces", [
    (['{"ids": [0]}'], [[0]]),
    (['{"ids": [3, 4]}', "", '{"input_ids": [5]}', "[7]"], [[3, 4], [5], [7]]),
])
def test_read_traces_takes_one_token_traces_and_skips_blank_lines(tmp_path, lines, traces):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert read_traces(path) == traces


@pytest.mark.parametrize("lines, says", [
    (['{"ids": []}'], "t.jsonl:1: expected a non-empty"),
    (["", '{"ids": [1]}', '{"ids": []}'], "t.jsonl:3: expected a non-empty"),
    (["", ""], "holds no traces"),
    (['{"ids": [1, -1]}'], "trace 1 of .*t.jsonl has token id -1"),
])
def test_read_traces_refuses_empty_traces_and_names_the_line(tmp_path, lines, says):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=says):  # TraceError, or TokenIdError for the id
        read_traces(path)
