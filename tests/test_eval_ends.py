"""Evaluation's mappings and tables at their exact ends, worked by hand: a token budget in each policy's own
parameters where the page count divides by 8 or does not, the per-length table from two lengths on."""

from __future__ import annotations

import math

import pytest

from rolecall.eval.budgets import policy_params
from rolecall.eval.grid_tables import length_lines


@pytest.mark.parametrize("budget, pages, recent", [
    (16, 1, 1), (127, 8, 1), (128, 8, 1), (129, 9, 1), (255, 16, 2), (256, 16, 2), (257, 17, 2),
    (1000, 63, 7), (1024, 64, 8), (1040, 65, 8), (1152, 72, 9), (2048, 128, 16),
])
def test_delta_budget_is_k_pages_with_the_floor_of_k_over_8_recent(budget, pages, recent):
    """K = ceil(budget / 16), L = max(1, floor(K / 8)): the paper's L/K = 8/64, never more recent pages than that
    share (a K that is not a multiple of 8 rounds L down)."""
    from rolecall.runtime.policies import get_policy

    params = policy_params("delta", budget)
    assert params == {"budget": budget, "page_size": 16, "recent_pages": recent}
    policy = get_policy("delta", **params)
    assert policy.num_pages == pages == math.ceil(budget / 16) and policy.recent_pages == recent


@pytest.mark.parametrize("budget, window, heavy", [(64, 16, 32), (1000, 250, 500), (1002, 250, 501), (7, 1, 3)])
def test_vattention_budget_splits_by_floor(budget, window, heavy):
    assert policy_params("vattention", budget) == {"epsilon": 0.05, "delta": 0.05, "sinks": 4, "window": window,
                                                    "heavy": heavy, "max_sample": budget}


def _row(label, lengths):
    return {"label": label, "budget": None, "task_lengths": {"passkey": {str(n): {"score": 0.5, "n": 4}
                                                                         for n in lengths}}}


@pytest.mark.parametrize("lengths, table", [([1024], False), ([1024, 2048], True), ([1024, 2048, 4096], True)])
def test_the_per_length_table_comes_from_two_lengths_on(lengths, table):
    lines = length_lines([_row("full", lengths)])
    assert bool(lines) == table
    if table:
        assert lines[3] == "| policy | budget | " + " | ".join(map(str, lengths)) + " |"
        assert lines[-1].startswith("| full | – | 0.500 [")


def _tuned(name, policy, low, read):
    return {"name": name, "policy": policy, "params": {}, "score": 0.9, "difference": low / 2,
            "interval": [low, 0.0], "n": 10, "attended_fraction": read, "tpot_ms": read * 10}


@pytest.mark.parametrize("low, max_drop, qualifies", [
    (-1.0, 1.0, False),  # a lower end exactly at −max_drop is not above it
    (-0.999, 1.0, True), (-1.001, 1.0, False), (0.0, 0.0, False), (0.001, 0.0, True), (-2.5, 2.5, False),
])
def test_a_setting_qualifies_only_with_its_lower_end_strictly_above_minus_the_drop(low, max_drop, qualifies):
    """``rolecall tune`` keeps a sparse setting whose paired interval's lower end lies above ``−max_drop``; at
    exactly ``−max_drop`` full attention (always qualified) is chosen."""
    from rolecall.eval.tune import choose

    rows = [_tuned("full", "full", 0.0, 1.0), _tuned("delta budget=64", "delta", low, 0.1)]
    for cost in ("keys", "tpot"):
        chosen, closest = choose(rows, max_drop, cost)
        assert chosen["name"] == ("delta budget=64" if qualifies else "full")
        assert (closest is None) == qualifies


@pytest.mark.parametrize("full, policy, kl", [
    # KL(full ‖ policy) = Σ p_full log(p_full / p_policy): 0.5 log(0.5/0.9) + 0.5 log(0.5/0.1) = log(5/3)
    ([0.5, 0.5], [0.9, 0.1], math.log(5 / 3)),
    # the other way round, 0.9 log(0.9/0.5) + 0.1 log(0.1/0.5)
    ([0.9, 0.1], [0.5, 0.5], 0.9 * math.log(1.8) + 0.1 * math.log(0.2)),
    # 0.8 log(0.8/0.4) + 2 · 0.1 log(0.1/0.3)
    ([0.8, 0.1, 0.1], [0.4, 0.3, 0.3], 0.8 * math.log(2) - 0.2 * math.log(3)),
    ([0.2, 0.3, 0.5], [0.2, 0.3, 0.5], 0.0),
])
def test_step_divergence_is_kl_of_full_against_policy_by_hand(full, policy, kl):
    """The KL direction matters: full attention's distribution weighs the log ratio (the tested policy is the
    approximation), so the pairs above differ from their mirror images."""
    import torch

    from rolecall.eval.runner import step_divergence

    lf = torch.tensor([full], dtype=torch.float64).log()
    lp = torch.tensor([policy], dtype=torch.float64).log()
    got, top1 = step_divergence(lf, lp)
    assert float(got[0]) == pytest.approx(kl, abs=1e-6)
    assert bool(top1[0]) == (max(range(len(full)), key=full.__getitem__) == max(range(len(policy)), key=policy.__getitem__))
