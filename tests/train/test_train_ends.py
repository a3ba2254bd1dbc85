"""Training's counts and roles at their exact ends, worked by hand: prefill chunks when the chunk divides the
prompt, exact-target roles with gates at E[z] = 0 and gates held open, a sample whose first target is its second
token, a token budget whose fraction of the keys is a whole number, the step that opens a new epoch, each
process's share of a batch, held-open layers of hybrid models, selections aligned across windows, a sparse head
left with no inherited key, the E[L0] goal, log(1 − eˣ) on both sides of its switch, and checkpoint names."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rolecall.train.config import target_keys
from rolecall.train.distill import prefill_calls, split_sample
from rolecall.train.hybrid import GateLayout, budget_tokens
from rolecall.train.outputs import head_roles
from rolecall.train.recipe import sample_index


@pytest.mark.parametrize("tokens, chunk, calls", [
    (1, 1, 1), (1, 1000, 1), (999, 1000, 1), (1000, 1000, 1), (1001, 1000, 2), (2000, 1000, 2),
    (4096, 1000, 5), (4000, 1000, 4), (4096, 4096, 1), (4097, 4096, 2), (48, 16, 3), (49, 16, 4),
])
def test_prefill_calls_are_the_ceiling_of_prompt_over_chunk(tokens, chunk, calls):
    """``ceil(P / chunk)`` forwards fill a prompt of P tokens; a chunk that divides P exactly takes no extra one."""
    assert prefill_calls(tokens, chunk) == calls


@pytest.mark.parametrize("expected, target, held, roles", [
    # a gate at exactly E[z] = 0 is still a learned gate: it may take one of the target places (ties: earlier)
    ([[0.0, 0.0], [0.0, 0.3]], 2, None, [[1, 0], [0, 1]]),
    ([[0.0, 0.0], [0.0, 0.0]], 4, None, [[1, 1], [1, 1]]),
    ([[0.0, 0.0], [0.0, 0.0]], 1, None, [[1, 0], [0, 0]]),
    # gates held open never take a place, however high their E[z]; the rest fill the target
    ([[1.0, 0.0], [0.0, 0.2]], 3, [[True, False], [False, False]], [[0, 1], [1, 1]]),
    ([[1.0, 0.0], [0.0, 0.2]], 2, [[True, False], [False, False]], [[0, 1], [0, 1]]),
    # more places than learned gates: every learned gate, and no held one
    ([[0.5, 0.0], [1.0, 0.0]], 4, [[False, False], [True, False]], [[1, 1], [0, 1]]),
])
def test_exact_target_roles_count_gates_at_zero_and_skip_held_ones(expected, target, held, roles):
    held_t = None if held is None else torch.tensor(held)
    got = head_roles(torch.tensor(expected), target, exact=True, held=held_t)
    assert got.tolist() == roles


@pytest.mark.parametrize("expected, roles", [
    ([[0.5, 0.5000001], [0.4999999, 1.0]], [[0, 1], [0, 1]]),  # E[z] > 0.5, strictly
    ([[0.0, 0.25], [0.75, 0.5]], [[0, 0], [1, 0]]),
])
def test_roles_without_exact_target_are_e_z_strictly_above_one_half(expected, roles):
    assert head_roles(torch.tensor(expected, dtype=torch.float64), 1, exact=False).tolist() == roles


# -- the sample's prompt, span and targets -----------------------------------------------------------------------------
@pytest.mark.parametrize("targets, prompt, span, mask", [
    # the logits at position t predict token t + 1: a target at 1 needs only token 0 as input, and no prompt
    ([1], 0, [100], [True]),
    ([9], 8, [108], [True]),  # the last token as the only target
    ([3, 5], 2, [102, 103, 104], [True, False, True]),  # a gap inside the span is in the span, not a target
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 0, [100, 101, 102, 103, 104, 105, 106, 107, 108], [True] * 9),
    ([4, 5], 3, [103, 104], [True, True]),
])
def test_split_sample_cuts_at_the_first_and_last_target(targets, prompt, span, mask):
    ids = torch.arange(100, 110)
    labels = torch.full((10,), -100)
    labels[targets] = ids[targets]
    got = split_sample(ids, labels)
    assert got.prompt.tolist() == [list(range(100, 100 + prompt))]
    assert got.span.tolist() == [span] and got.mask.tolist() == mask
    assert got.num_targets == len(targets)
    # the keys the student reads at the last target: the prompt and the span, up to the last target's input
    assert target_keys(ids, labels, "s") == prompt + len(span) == targets[-1]


@pytest.mark.parametrize("targets", [[0], [0, 5]])
def test_a_target_at_the_first_token_is_refused(targets):
    ids, labels = torch.arange(10), torch.full((10,), -100)
    labels[targets] = 1
    with pytest.raises(ValueError, match="first target token is the first token"):
        split_sample(ids, labels)
    with pytest.raises(ValueError, match="labels its first token as a target"):
        target_keys(ids, labels, "s")


# -- the token budget --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget, keys, tokens", [
    (0.25, 8, 2), (0.25, 9, 3), (0.25, 7, 2), (0.125, 8, 1), (0.125, 9, 2), (0.75, 4, 3), (0.75, 5, 4),
    (0.5, 1, 1), (1e-9, 5, 1), (1.0, 1, 1), (1, 1, 1), (2, 1, 1), (1, 5, 1), (5, 5, 5), (6, 5, 5),
])
def test_budget_tokens_rounds_a_fraction_up_and_clamps_to_one_and_the_keys(budget, keys, tokens):
    """A fraction keeps ceil(budget · keys) keys (exact in binary here, so a product that divides exactly takes no
    extra key), at least 1; a count keeps itself, at most every key."""
    assert budget_tokens(budget, keys) == tokens


# -- the data order ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_each_epoch_of_sample_index_is_one_permutation_of_the_samples(n):
    """Steps e·n … e·n + n − 1 are epoch e: together they visit every sample once, in the order of that epoch's
    own permutation (seeded by (seed, e)); step n is the first of epoch 1, not the last of epoch 0."""
    import numpy as np

    order = [sample_index(s, n, seed=11) for s in range(3 * n)]
    for epoch in range(3):
        block = order[epoch * n : (epoch + 1) * n]
        assert sorted(block) == list(range(n))
        assert block == np.random.default_rng([11, epoch]).permutation(n).tolist()


@pytest.mark.parametrize("step, batch, world, rank, positions", [
    (0, 1, 1, 0, [0]), (3, 4, 1, 0, [12, 13, 14, 15]), (3, 4, 2, 0, [12, 14]), (3, 4, 2, 1, [13, 15]),
    (2, 4, 4, 3, [11]), (2, 4, 4, 0, [8]), (0, 2, 2, 1, [1]), (5, 3, 3, 2, [17]),
])
def test_a_processes_share_of_the_batch_is_round_robin(monkeypatch, step, batch, world, rank, positions):
    """Data positions step·B … step·B + B − 1 (the last inclusive), every world-th from the process's rank."""
    from types import SimpleNamespace

    from rolecall.core import distributed
    from rolecall.train.recipe import _step_positions

    monkeypatch.setattr(distributed, "rank", lambda: rank)
    monkeypatch.setattr(distributed, "world_size", lambda: world)
    assert _step_positions(step, SimpleNamespace(batch_size=batch)) == positions


# -- hybrid layers -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers, sliding, first_full, held, gated, open_rows", [
    (4, (), 0, [], 6, None),
    (4, (0,), 1, [1], 4, [True, False, False]),  # the first full layer past layer 0 is held open
    (6, (0, 1, 3), 2, [1, 2, 3], 4, [True, True, True, False, False]),
    (6, (1, 3), 0, [1, 3], 6, [True, False, True, False, False]),  # layer 0 full: it is the first, never gated
    (3, (0, 1, 2), 0, [1, 2], 0, [True, True]),  # every layer sliding: layer 0 by default
    (2, (0,), 1, [1], 0, [True]),
    (2, (), 0, [], 2, None),
])
def test_gate_layout_at_its_ends(layers, sliding, first_full, held, gated, open_rows):
    """Gates of layers 1..L−1 (row i − 1 for layer i), two KV heads: sliding layers and the first full layer past
    layer 0 are held open; what is left is learned."""
    layout = GateLayout(layers, sliding)
    assert (layout.first_full, layout.held, layout.gated_heads(2)) == (first_full, held, gated)
    mask = layout.fixed_open(2)
    if open_rows is None:
        assert mask is None
    else:
        assert mask.tolist() == [[row, row] for row in open_rows]


@pytest.mark.parametrize("have, t, want", [
    ([1, 0, 1], 3, [1, 0, 1]),
    ([1, 0, 1, 1], 3, [0, 1, 1]),  # more keys: the last t, right-aligned on the current position
    ([1, 0, 1, 1], 1, [1]),
    ([1, 1], 4, [0, 0, 1, 1]),  # fewer keys (a window): unselected on the left
    ([1], 2, [0, 1]),
])
def test_a_selection_aligns_on_the_right(have, t, want):
    from rolecall.train.hybrid import _align

    got = _align(torch.tensor(have, dtype=torch.bool)[None, None, None], t)
    assert got[0, 0, 0].int().tolist() == want


@pytest.mark.parametrize("inherited, keep, read", [
    ([0, 1, 0, 0], [1, 1, 1, 0], [0, 1, 0, 0]),
    ([1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0]),  # never a masked key
    ([0, 0, 0, 1], [1, 1, 1, 0], [0, 0, 1, 0]),  # nothing inherited within keep: the query's own (last kept) key
    ([1, 0, 0, 0], [0, 1, 1, 1], [0, 0, 0, 1]),  # a window that hides the inherited key
    ([0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]),  # one key in all
])
def test_a_sparse_head_reads_its_own_key_when_nothing_inherited_is_left(inherited, keep, read):
    from rolecall.train.hybrid import sparse_keys

    got = sparse_keys(torch.tensor(inherited, dtype=torch.bool)[None, None, None],
                      torch.tensor(keep, dtype=torch.bool)[None, None, None])
    assert got[0, 0, 0].int().tolist() == read


# -- gates -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, held_rows, target, p, goal", [
    ("hardkuma", 0, 2, 0.1, 2 * 0.8 + 6 * 0.1),  # target (1 − 2p) + n p over n = 6 learned gates
    ("hardkuma", 1, 2, 0.1, 2 * 0.8 + 4 * 0.1),  # a held row of 2 gates: n = 4
    ("hardconcrete", 2, 1, 0.25, 1 * 0.5 + 2 * 0.25),
    ("hardkuma", 0, 6, 0.1, 6 * 0.8 + 6 * 0.1),  # every gate: n (1 − p)
    ("hardkuma", 0, 2, 0.0, 2.0),  # no bound: the target itself
    ("sigmoid", 1, 2, 0.1, 2.0),  # no probabilities: the target itself
])
def test_l0_goal_by_hand(kind, held_rows, target, p, goal):
    from rolecall.train.gates import GateParameters

    held = torch.zeros(3, 2, dtype=torch.bool)
    held[:held_rows] = True
    g = GateParameters(kind, (3, 2), fixed_open=held)
    assert g.l0_goal(target, p) == pytest.approx(goal, rel=1e-12)


@pytest.mark.parametrize("x", [-1e-12, -1e-3, -0.5, -math.log(2) + 1e-9, -math.log(2), -math.log(2) - 1e-9, -1.0,
                               -5.0, -40.0])
def test_log1mexp_on_both_sides_of_its_switch(x):
    """log(1 − eˣ) against Python's own expm1, on either side of Mächler's switch at −log 2."""
    from rolecall.train.gates import log1mexp

    got = log1mexp(torch.tensor(x, dtype=torch.float64)).item()
    assert got == pytest.approx(math.log(-math.expm1(x)), rel=1e-12)


# -- checkpoints -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("output, folder", [
    ("m.safetensors", "m.ckpt"), ("m.bin", "m.bin.ckpt"), ("a.safetensors.safetensors", "a.safetensors.ckpt"),
])
def test_checkpoint_folder_drops_one_safetensors_suffix(tmp_path, output, folder):
    from rolecall.train.checkpoint import checkpoint_dir

    assert checkpoint_dir(tmp_path / output) == tmp_path / folder


@pytest.mark.parametrize("steps, latest", [([9, 10], 10), ([1], 1), ([99, 100, 1000], 1000), ([0, 9999999], 9999999)])
def test_the_latest_checkpoint_is_the_highest_step(tmp_path, steps, latest):
    """Step numbers are padded to 7 digits, so names sort as numbers: step 10 comes after step 9."""
    from rolecall.train.checkpoint import checkpoint_dir, checkpoint_path, latest_checkpoint

    checkpoint_dir(tmp_path / "m.safetensors").mkdir()
    for s in steps:
        checkpoint_path(tmp_path / "m.safetensors", s).write_bytes(b"")
    assert latest_checkpoint(tmp_path / "m.safetensors").name == f"step-{latest:07d}.pt"


@pytest.mark.parametrize("saved, reason, accepted", [
    ("abc", None, True), ("abc", "lr differs", True), (None, None, True), (None, "lr differs", False),
    ("xyz", None, False),
])
def test_check_run_accepts_its_own_id_and_an_id_less_checkpoint_only_without_a_reason(saved, reason, accepted):
    from rolecall.train.checkpoint import CheckpointError, check_run

    state = {} if saved is None else {"run_id": saved}
    if accepted:
        check_run(state, Path("c/step-0000001.pt"), "abc", reason)
    else:
        with pytest.raises(CheckpointError, match="belongs to another run"):
            check_run(state, Path("c/step-0000001.pt"), "abc", reason)


@pytest.mark.parametrize("config, portable", [
    ({"output": "/runs/x/m.safetensors"}, {"output": "m.safetensors"}),
    ({"dataset": "passkey"}, {"dataset": "passkey"}),  # the builder's name stays
    ({"dataset": "/data/s.jsonl"}, {"dataset": "s.jsonl"}),
    ({"data_source": "text:/data/a.txt", "model": "smollm2-135m"}, {"data_source": "text:a.txt", "model": "smollm2-135m"}),
    ({"model": "/models/llama"}, {"model": "llama"}),
    ({"output": None, "dataset": "", "lr": 0.1}, {"output": None, "dataset": "", "lr": 0.1}),  # unset stays unset
])
def test_a_manifest_records_paths_by_file_name(config, portable):
    from rolecall.train.outputs import portable_config

    assert portable_config(config) == portable
