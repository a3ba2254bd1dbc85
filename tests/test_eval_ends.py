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


def _tuned_row(name, policy, low, difference, read, tpot=1.0):
    """A row of ``rolecall tune``'s table: its paired interval [low, 0], its cost in keys read and in TPOT."""
    return {"name": name, "policy": policy, "params": {}, "score": 0.9, "difference": difference,
            "interval": [low, 0.0], "n": 10, "attended_fraction": read, "tpot_ms": tpot}


@pytest.mark.parametrize("low, max_drop, qualifies", [
    (-1.0, 1.0, False),  # a lower end exactly at −max_drop is not above it
    (-0.999, 1.0, True), (-1.001, 1.0, False), (0.0, 0.0, False), (0.001, 0.0, True), (-2.5, 2.5, False),
])
def test_a_setting_qualifies_only_with_its_lower_end_strictly_above_minus_the_drop(low, max_drop, qualifies):
    """``rolecall tune`` keeps a sparse setting whose paired interval's lower end lies above ``−max_drop``; at
    exactly ``−max_drop`` full attention (always qualified) is chosen."""
    from rolecall.eval.tune import choose

    rows = [_tuned_row("full", "full", 0.0, 0.0, 1.0, 10.0), _tuned_row("delta budget=64", "delta", low, low / 2, 0.1)]
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


# -- intervals ---------------------------------------------------------------------------------------------------------------
Z = 1.959964


@pytest.mark.parametrize("successes, n, low, high", [
    # p = 0: the interval is [0, z² / (n + z²)]; p = 1: [n / (n + z²), 1]
    (0, 1, 0.0, Z * Z / (1 + Z * Z)),
    (1, 1, 1 / (1 + Z * Z), 1.0),
    (0, 10, 0.0, Z * Z / (10 + Z * Z)),
    (10, 10, 10 / (10 + Z * Z), 1.0),
])
def test_wilson_interval_at_a_share_of_0_and_1(successes, n, low, high):
    from rolecall.eval.stats import wilson_interval

    got = wilson_interval(successes, n)
    assert got[0] == pytest.approx(low, abs=1e-12) and got[1] == pytest.approx(high, abs=1e-12)
    assert got[0] >= 0.0 and got[1] <= 1.0


@pytest.mark.parametrize("successes, n", [(1, 2), (5, 10), (2.5, 5)])
def test_wilson_interval_of_one_half_is_centred(successes, n):
    """At p = 1/2 the centre (p + z²/2n) / (1 + z²/n) is 1/2: the ends sum to 1; a fractional count is used."""
    from rolecall.eval.stats import wilson_interval

    low, high = wilson_interval(successes, n)
    assert low + high == pytest.approx(1.0, abs=1e-12) and low < 0.5 < high


def test_wilson_interval_needs_one_prompt():
    from rolecall.eval.stats import wilson_interval

    with pytest.raises(ValueError, match="n >= 1"):
        wilson_interval(0, 0)


@pytest.mark.parametrize("a, b, mean, half", [
    ([1.0], [0.0], 1.0, 0.0),  # one pair: no spread
    ([1.0, 3.0], [0.0, 0.0], 2.0, Z * math.sqrt(2) / math.sqrt(2)),  # sd = √2 with n − 1 = 1
    ([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], 1.0, 0.0),
    ([0.0, 0.0, 3.0], [0.0, 0.0, 0.0], 1.0, Z * math.sqrt(3) / math.sqrt(3)),  # Σ(d − 1)² = 6, / 2 → sd √3
])
def test_paired_difference_by_hand(a, b, mean, half):
    from rolecall.eval.stats import paired_difference

    got = paired_difference(a, b)
    assert got["mean"] == pytest.approx(mean) and got["n"] == len(a)
    assert got["interval"] == pytest.approx([mean - half, mean + half])


@pytest.mark.parametrize("a, b", [([], []), ([1.0], [1.0, 2.0])])
def test_paired_difference_needs_equal_non_empty_lists(a, b):
    from rolecall.eval.stats import paired_difference

    with pytest.raises(ValueError, match="equally long non-empty"):
        paired_difference(a, b)


@pytest.mark.parametrize("values, weights, interval", [
    ([0.4], [3.0], (0.4, 0.4)),  # one prompt: every resample is it
    ([0.7, 0.7, 0.7], [1.0, 2.0, 5.0], (0.7, 0.7)),
])
def test_bootstrap_interval_without_spread(values, weights, interval):
    from rolecall.eval.stats import bootstrap_interval

    assert bootstrap_interval(values, weights, reps=50) == pytest.approx(interval)


@pytest.mark.parametrize("cells, score, n", [
    ([], None, None), ([{"score": 0.5, "n": 0}], None, None),
    ([{"score": 0.5, "n": 2}, {"score": 1.0, "n": 2}], 0.75, 4),
    ([{"score": 0.5, "n": 2}, {"score": 1.0, "n": 0}], 0.5, 2),  # a cell without prompts weighs nothing
])
def test_pooled_weighs_cells_by_their_prompts(cells, score, n):
    from rolecall.eval.stats import pooled

    got = pooled(cells)
    assert (got is None) == (score is None)
    if got is not None:
        assert got["score"] == pytest.approx(score) and got["n"] == n


# -- rolecall tune: ties and candidates --------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows, cost, chosen", [
    # the same cost as full attention: full wins the tie
    ([_tuned_row("full", "full", 0.0, 0.0, 1.0), _tuned_row("delta b", "delta", -0.5, -0.1, 1.0)], "keys", "full"),
    # equal costs among sparse rows: the higher difference, then the name
    ([_tuned_row("full", "full", 0.0, 0.0, 1.0), _tuned_row("quest a", "quest", -0.5, -0.2, 0.1),
      _tuned_row("delta b", "delta", -0.5, -0.1, 0.1)], "keys", "delta b"),
    ([_tuned_row("full", "full", 0.0, 0.0, 1.0), _tuned_row("quest a", "quest", -0.5, -0.1, 0.1),
      _tuned_row("delta b", "delta", -0.5, -0.1, 0.1)], "keys", "delta b"),  # the name first in order
    # an untimed row costs infinitely much in TPOT, nothing more in keys
    ([_tuned_row("full", "full", 0.0, 0.0, 1.0, 2.0), _tuned_row("delta b", "delta", -0.5, 0.0, 0.1, None)], "tpot", "full"),
    ([_tuned_row("full", "full", 0.0, 0.0, 1.0, 2.0), _tuned_row("delta b", "delta", -0.5, 0.0, 0.1, None)], "keys", "delta b"),
])
def test_choose_breaks_ties_towards_full_then_the_difference_then_the_name(rows, cost, chosen):
    from rolecall.eval.tune import choose

    assert choose(rows, 1.0, cost)[0]["name"] == chosen


@pytest.mark.parametrize("lows, closest", [
    ([-2.0, -3.0], "a"),  # the highest lower end
    ([-2.0, -2.0], "b"),  # a tie: the later name
])
def test_choose_names_the_closest_sparse_row_when_none_qualifies(lows, closest):
    from rolecall.eval.tune import choose

    rows = [_tuned_row("full", "full", 0.0, 0.0, 1.0), _tuned_row("a", "delta", lows[0], -2.5, 0.1),
            _tuned_row("b", "quest", lows[1], -2.5, 0.1)]
    chosen, near = choose(rows, 1.0, "keys")
    assert chosen["name"] == "full" and near["name"] == closest


def test_candidates_sorted_once_each_with_delta_refines():
    from rolecall.eval.tune import candidates

    names = [c.name for c in candidates(["layers"], ("delta", "quest"), (64, 1, 64), (2, 1))]
    assert names == ["full", "delta budget=1", "delta budget=1 refine=2", "delta budget=64",
                     "delta budget=64 refine=2", "quest budget=1", "quest budget=64"]


@pytest.mark.parametrize("budgets, refines, says", [((0, 64), (1,), "budgets"), ((64,), (0,), "refine"),
                                                    ((), (1,), "budgets")])
def test_candidates_refuse_budgets_and_refines_below_1(budgets, refines, says):
    from rolecall.eval.tune import candidates

    with pytest.raises(ValueError, match=f"^{says}"):
        candidates(["layers"], ("delta",), budgets, refines)


@pytest.mark.parametrize("policy, budget, refine, name, slug, refined", [
    ("full", None, 1, "full", "full", False),
    ("delta", 64, 1, "delta budget=64", "delta_budget64", False),
    ("delta", 64, 2, "delta budget=64 refine=2", "delta_budget64_refine2", True),
])
def test_candidate_names(policy, budget, refine, name, slug, refined):
    from rolecall.eval.tune import Candidate

    c = Candidate(policy, budget, refine)
    assert c.name == name and c.slug == slug and ("refine" in c.params) == refined


# -- the evaluation's batches and records --------------------------------------------------------------------------------------
def _samples(lengths, budgets=None):
    return [{"input_ids": [0] * n, **({} if budgets is None else {"max_new_tokens": budgets[i]})}
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("lengths, budgets, size, batches", [
    ([5, 5, 5, 5], None, 2, [[0, 1], [2, 3]]),  # the size divides the group
    ([5, 5, 5, 5], None, 3, [[0, 1, 2], [3]]),  # one past: a batch of one
    ([5, 5, 5, 5], None, 4, [[0, 1, 2, 3]]),
    ([5, 5, 5, 5], None, 1, [[0], [1], [2], [3]]),
    ([7, 5, 7, 5], None, 4, [[1, 3], [0, 2]]),  # one length a batch, shorter first
    ([5, 5, 5], [8, 4, 8], 4, [[1], [0, 2]]),  # one generation budget a batch, smaller first
    ([5, 7], [8, 4], 4, [[1], [0]]),  # the budget orders before the length
])
def test_batches_group_by_budget_and_length(lengths, budgets, size, batches):
    from rolecall.eval.runner import _batches

    assert _batches(_samples(lengths, budgets), size, 8) == batches


@pytest.mark.parametrize("fresh, finished, plan", [
    ([[0, 1], [2, 3]], [[0], [3]], [[0], [3], [1], [2]]),
    ([[0, 1], [2, 3]], [[0, 1]], [[0, 1], [2, 3]]),  # a whole batch finished drops out of the fresh plan
    ([[0, 1], [2, 3]], [], [[0, 1], [2, 3]]),
    ([[0, 1]], [[0, 1]], [[0, 1]]),
])
def test_resume_plan(fresh, finished, plan):
    from rolecall.eval.runner import resume_plan

    assert resume_plan(fresh, finished) == plan


@pytest.mark.parametrize("n, rows", [(1, []), (2, [[1.0]]), (3, [[1.0], [2.0]])])
def test_row_steps_are_steps_1_to_n_minus_1(n, rows):
    import torch

    from rolecall.eval.runner import row_steps

    steps = [torch.tensor([[float(i)], [10.0 + i]]) for i in range(3)]
    got = row_steps(steps, 0, n)
    assert got.tolist() == rows and got.shape == (n - 1, 1)


@pytest.mark.parametrize("total, other", [(10.0, 4.0), (6.0, 0.0), (5.0, 0.0)])
def test_time_split_other_is_the_rest_never_below_zero(total, other):
    """Parts 1 + 2 + 1 + 1 + 1 = 6 seconds: the rest of the total, 0 where the parts add up to more."""
    from rolecall.eval.runner import time_split

    seconds = {"setup": 1.0, "prefill": 2.0, "capture": 1.0, "decode": 1.0, "reference": 1.0, "total": total}
    got = time_split([{"figures": {"seconds": seconds}}, {"figures": None}, {}])
    assert got["batches"] == 1 and got["other"] == pytest.approx(other) and got["total"] == total


def test_time_split_off_the_engine_and_devices_in_first_order():
    from rolecall.eval.runner import devices_of, time_split

    assert time_split([{"figures": None}]) is None
    assert devices_of([{"device": "B"}, {"device": "A"}, {}, {"device": "B"}]) == {"B": 2, "A": 1}


def test_task_scores_group_by_task_and_length():
    from rolecall.eval.runner import task_scores

    records = [{"task": "t", "context_length": 8, "score": 1.0}, {"task": "t", "context_length": 8, "score": 0.0},
               {"task": "t", "context_length": 16, "score": 1.0}, {"task": "t", "context_length": 8, "score": None},
               {"task": None, "context_length": 8, "score": 1.0}]
    got = task_scores(records)
    assert list(got) == ["t"] and sorted(got["t"]) == ["16", "8"]
    assert (got["t"]["8"]["score"], got["t"]["8"]["n"]) == (0.5, 2) and got["t"]["16"]["n"] == 1


@pytest.mark.parametrize("generated, answer, correct", [
    ("The answer is 42.", "the answer", True), ("42", "42", True), ("4 2", "42", False), ("", "42", False),
    ("42 is it", "42 is it now", False),  # shorter than the answer
])
def test_answer_correct_is_a_word_prefix(generated, answer, correct):
    from rolecall.eval.runner import answer_correct

    assert answer_correct(generated, answer) is correct


@pytest.mark.parametrize("agree, position", [
    ([True, True, False, False], 4), ([False], 2), ([True, True], None), ([], None),
])
def test_lockstep_divergence_is_the_first_disagreeing_generated_position(agree, position):
    """agree[i] compares the (i + 2)-th generated token (the prefill's is the first)."""
    import torch

    from rolecall.eval.decoding import Lockstep

    steps = Lockstep([[]], [torch.zeros(len(agree))], [torch.tensor(agree, dtype=torch.bool)])
    assert steps.divergence(0) == position


# -- table cells -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, short", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA L4", "NVIDIA L4"),  # one digit is no model number: the name as it is
    ("NVIDIA L40S", "L40S"), (None, "?"), ("", "?"), ("CPU", "CPU"),
])
def test_short_gpu(name, short):
    from rolecall.eval.grid_tables import short_gpu

    assert short_gpu(name) == short


@pytest.mark.parametrize("row, wall", [
    ({"seconds": {"total": 12.5}, "wall_s": 3.0}, 12.5), ({"seconds": None, "wall_s": 3.0}, 3.0),
    ({"seconds": {}, "wall_s": 3.0}, 3.0), ({"wall_s": 4.0}, 4.0),
])
def test_wall_of(row, wall):
    from rolecall.eval.grid_tables import wall_of

    assert wall_of(row) == wall


@pytest.mark.parametrize("row, scores", [
    (None, None), ({}, None), ({"scores": []}, None), ({"scores": [1.0, None]}, None), ({"scores": [0.0, 1.0]}, [0.0, 1.0]),
])
def test_pairable_scores(row, scores):
    from rolecall.eval.grid_tables import pairable_scores

    assert pairable_scores(row) == scores


@pytest.mark.parametrize("names, devices, several", [
    (["NVIDIA H100 and NVIDIA H200", "NVIDIA H200", None], ["NVIDIA H100", "NVIDIA H200", None], True),
    (["NVIDIA H200", "NVIDIA H200"], ["NVIDIA H200"], False),
    (["NVIDIA H200", "NVIDIA H100"], ["NVIDIA H200", "NVIDIA H100"], True),  # first seen first, not sorted
    ([None], [None], False),
])
def test_device_names_each_once_in_order(names, devices, several):
    from rolecall.eval.grid_tables import device_names, several_gpus

    rows = [{"device_name": n} for n in names]
    assert device_names(rows) == devices and several_gpus(rows) is several
