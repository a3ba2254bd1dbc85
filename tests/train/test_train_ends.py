"""Training's counts and roles at their exact ends, worked by hand: prefill chunks when the chunk divides the
prompt, exact-target roles with gates at E[z] = 0 and gates held open."""

from __future__ import annotations

import pytest
import torch

from rolecall.train.distill import prefill_calls
from rolecall.train.outputs import head_roles


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
