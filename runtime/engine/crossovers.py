"""Below how many tokens a sparse policy should run the full step: the measured crossovers in
``crossovers.json`` (data written from ``benchmarks/decode.py`` runs, not constants in code)."""

from __future__ import annotations

import functools
import importlib.resources
import json
from typing import Any

NEVER = 1 << 62  # a threshold no context reaches: the policy always runs the full step


@functools.cache
def table() -> dict[str, Any]:
    return json.loads((importlib.resources.files("runtime.engine") / "crossovers.json").read_text())


def default_min_context(policy: Any, batch: int) -> int:
    """The crossover for ``policy`` (a name or a policy) at ``batch`` rows: the row of the largest measured
    batch not above ``batch`` (the crossover only falls as the batch grows, so this errs towards the full
    step); 0 for ``full`` or a policy without measurements, :data:`NEVER` where the sparse step never won.
    Other budgets shift the crossovers (a larger budget wins later); pass ``min_context`` for them."""
    name = getattr(policy, "name", policy)
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    rows = table()["policies"].get(name)
    if not rows:
        return 0
    row = [r for r in rows if r["from_batch"] <= batch][-1]
    return NEVER if row["min_context"] is None else int(row["min_context"])
