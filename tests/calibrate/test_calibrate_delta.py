"""Δ-layer selection and Lethe budgets on curves and recall matrices with known answers."""

from __future__ import annotations

import itertools

import pytest
import torch

from rolecall.calibrate.delta import (
    choose_delta_layers,
    get_selector,
    layer_roles,
    mean_sparse_recall,
    recall_per_layer,
)
from rolecall.calibrate.lethe import LetheBudget


def curve(num_layers: int, peaks: dict[int, float]) -> list[float]:
    c = [0.1] * num_layers
    c[0] = 0.0
    for layer, height in peaks.items():
        c[layer] = height
    return c


def test_peaks_spread_over_depth():
    shift = curve(30, {3: 1.0, 7: 0.5, 15: 0.9, 16: 0.85, 25: 0.7})
    assert choose_delta_layers(shift, 1) == [2]
    # 3 is too close to the warm-up Δ-layer (gap 3), 16 is not a peak beside 15
    assert choose_delta_layers(shift, 3, warmup=2, min_gap=3) == [2, 15, 25]
    assert choose_delta_layers(shift, 4, warmup=2, min_gap=3) == [2, 7, 15, 25]
    assert choose_delta_layers(shift, 3, warmup=0, min_gap=3) == [0, 3, 15]


def test_peaks_fill_up_when_the_curve_has_too_few():
    shift = [float(i) for i in range(12)]  # monotone: only the last layer is a peak
    assert choose_delta_layers(shift, 3, warmup=2, min_gap=3) == [2, 8, 11]
    assert choose_delta_layers(shift, 10, warmup=2, min_gap=3) == list(range(2, 12))
    with pytest.raises(ValueError, match="num_delta"):
        choose_delta_layers(shift, 11, warmup=2)
    with pytest.raises(ValueError, match="num_delta"):
        choose_delta_layers(shift, 0)


def test_roles_and_recall_per_layer():
    assert layer_roles(6, [2, 4], 2).tolist() == [0, 0, 1, 2, 1, 2]
    recall = torch.arange(36.0).reshape(6, 6) / 100  # recall[s, l] = (6 s + l) / 100
    per = recall_per_layer(recall, [2, 4], 2)
    assert per.tolist() == pytest.approx([1, 1, 1, 0.15, 1, 0.29])
    assert mean_sparse_recall(recall, [2, 4], 2) == pytest.approx((0.15 + 0.29) / 2)
    with pytest.raises(ValueError, match="warm-up"):
        recall_per_layer(recall, [3], 2)


def random_recall(num_layers: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(num_layers, num_layers, generator=g, dtype=torch.float64) * 0.6 + 0.3


def test_recall_selector_first_step_is_the_exhaustive_best():
    recall = random_recall(10, 0)
    chosen = get_selector("recall", warmup=2)(torch.zeros(10), recall, 2)
    best = max(range(3, 10), key=lambda c: mean_sparse_recall(recall, [2, c], 2))
    assert chosen == [2, best]
    # and greedy never does worse than DELTA's peaks for the same count
    peaks = get_selector("peaks", warmup=2, min_gap=2)(torch.rand(10), recall, 3)
    greedy = get_selector("recall", warmup=2)(torch.zeros(10), recall, 3)
    assert mean_sparse_recall(recall, greedy, 2) >= mean_sparse_recall(recall, peaks, 2) - 1e-12
    exhaustive = max(mean_sparse_recall(recall, [2, *c], 2) for c in itertools.combinations(range(3, 10), 2))
    assert mean_sparse_recall(recall, greedy, 2) <= exhaustive + 1e-12


def test_recall_selector_finds_the_layer_that_explains_the_rest():
    recall = torch.full((8, 8), 0.5, dtype=torch.float64)
    recall[5, 6:] = 1.0  # layer 5's pages hold all the mass of the layers after it
    assert get_selector("recall", warmup=1)(torch.zeros(8), recall, 2) == [1, 5]


@pytest.mark.parametrize("name", ["peaks", "recall"])
def test_auto_takes_the_smallest_set_reaching_the_target(name):
    recall = random_recall(12, 1)
    shift = torch.rand(12, generator=torch.Generator().manual_seed(2))
    target = 0.72
    chosen = get_selector(name, warmup=2, min_gap=2, target_recall=target)(shift, recall, "auto")
    assert mean_sparse_recall(recall, chosen, 2) >= target
    smaller = get_selector(name, warmup=2, min_gap=2)(shift, recall, len(chosen) - 1) if len(chosen) > 1 else None
    if smaller is not None:
        assert mean_sparse_recall(recall, smaller, 2) < target


@pytest.mark.parametrize("name", ["peaks", "recall"])
def test_auto_stops_at_a_set_whose_recall_equals_the_target(name):
    # Warm-up 1 of 4 layers, every pair recalls 0.5 (exact in binary): Δ = [1] alone leaves layers 2 and 3
    # sparse, each reading layer 1's pages, mean (0.5 + 0.5) / 2 = 0.5; the target is "reaches", so 0.5 is enough.
    recall = torch.full((4, 4), 0.5, dtype=torch.float64)
    chosen = get_selector(name, warmup=1, min_gap=1, target_recall=0.5)(torch.zeros(4), recall, "auto")
    assert chosen == [1]


def test_unknown_selector_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of peaks, recall"):
        get_selector("best")


def test_lethe_budgets_follow_density_and_meet_the_total():
    sparsity = torch.tensor([[0.9, 0.9], [0.5, 0.7], [0.2, 0.4], [0.8, 0.8]])  # mean 0.9, 0.6, 0.3, 0.8
    budget = LetheBudget(budget=0.25, min_budget=0.0)(sparsity)
    assert budget.mean().item() == pytest.approx(0.25, rel=1e-6)
    density = torch.tensor([0.1, 0.4, 0.7, 0.2])
    torch.testing.assert_close(budget, (density / density.sum() * 4 * 0.25).float())  # no clipping: proportional
    clipped = LetheBudget(budget=0.5, min_budget=0.2)(sparsity)  # 0.7-density layer would want 1.0 + spill
    assert clipped.mean().item() == pytest.approx(0.5, rel=1e-5)
    assert clipped.max().item() <= 1.0 and clipped.min().item() >= 0.2 - 1e-7
    assert torch.equal(clipped.argsort(), density.argsort())
    with pytest.raises(ValueError, match="budget"):
        LetheBudget(budget=1.5)


@pytest.mark.parametrize("sparsity, budget, floor, expected", [
    # c = 4/3: the dense layer clips at 1 and the other three share the rest, (1 + 3 · c/2) / 4 = 0.75
    ([0.0, 0.5, 0.5, 0.5], 0.75, 0.02, [1.0, 2 / 3, 2 / 3, 2 / 3]),
    # c = 1.2: one layer clips at 1, (1 + 1.2 · (0.5 + 0.5 + 0.2)) / 4 = 0.61
    ([0.0, 0.5, 0.5, 0.8], 0.61, 0.02, [1.0, 0.6, 0.6, 0.24]),
    # the floor: 0.01 · c < 0.1, so (0.1 + 3 c) / 4 = 0.5 gives c = 1.9 / 3
    ([0.99, 0.0, 0.0, 0.0], 0.5, 0.1, [0.1, 1.9 / 3, 1.9 / 3, 1.9 / 3]),
    # a budget of 1 keeps everything, whatever the densities
    ([0.9, 0.5, 0.0, 0.3], 1.0, 0.02, [1.0, 1.0, 1.0, 1.0]),
    # equal densities: every layer gets the budget
    ([0.4, 0.4, 0.4], 0.3, 0.02, [0.3, 0.3, 0.3]),
])
def test_lethe_budgets_at_the_clip_ends_by_hand(sparsity, budget, floor, expected):
    """b_l = clip(c · (1 − s̄_l), min_budget, 1) with the c that makes the mean equal the budget, worked by hand
    where layers sit at the ceiling of 1 (c above 1 / the largest density) or at the floor."""
    got = LetheBudget(budget=budget, min_budget=floor)(torch.tensor(sparsity))
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=0)
    assert got.mean().item() == pytest.approx(budget, abs=1e-5)
