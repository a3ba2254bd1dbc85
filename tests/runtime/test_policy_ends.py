"""The policies' sizes at their exact ends, worked by hand: tokens read per layer when the context is shorter
than a window or a budget, block counts when the recent tokens outnumber the budget, shares at a threshold."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rolecall.runtime.policies import mean_tokens_read


@pytest.mark.parametrize("windows, context, budget, full, reads", [
    # a window longer than the context reads the context: (10 + 10 + 10) / 3
    ([None, None, 16], 10, 16, [1.0, 0.0, 0.0], (10 + 10 + 10) / 3),
    # a window exactly the context reads it; one shorter reads the window
    ([None, 10, 4], 10, 16, [1.0, 0.0, 0.0], (10 + 10 + 4) / 3),
    # a budget above the context reads the context, one below reads the budget, a half-full layer both
    ([None, None], 10, 16, [0.0, 0.5], (10 + 10) / 2),
    ([None, None], 10, 6, [0.0, 0.5], (6 + 0.5 * 10 + 0.5 * 6) / 2),
    # every layer windowed (Mistral) at a context below the window: the context
    ([8, 8, 8, 8], 5, 2, [0.0, 0.0, 0.0, 0.0], 5.0),
    ([8, 8, 8, 8], 9, 2, [0.0, 0.0, 0.0, 0.0], 8.0),
])
def test_tokens_read_never_exceed_the_context(windows, context, budget, full, reads):
    """A layer reads min(context, window) with a window, else ``f · context + (1 − f) · min(context, budget)``."""
    assert mean_tokens_read(SimpleNamespace(windows=windows), context, budget, full) == pytest.approx(reads)
