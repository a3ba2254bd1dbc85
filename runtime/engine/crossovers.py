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
    return json.loads((importlib.resources.files("rolecall.runtime.engine") / "crossovers.json").read_text())


def budget_of(policy: Any) -> int | None:
    """The tokens a policy's sparse step reads (delta's pages × page size, or its ``budget``); None if unknown."""
    pages, size = getattr(policy, "num_pages", None), getattr(policy, "page_size", None)
    if isinstance(pages, int) and isinstance(size, int):
        return pages * size
    budget = getattr(policy, "budget", None)
    return budget if isinstance(budget, int) else None


def default_min_context(policy: Any, batch: int, budget: int | None = None) -> int:
    """The crossover for ``policy`` (a name or a policy) at ``batch`` rows and ``budget`` tokens read (default:
    the policy's own, :func:`budget_of`; for a bare name, the table's budget): the rows measured at the smallest
    budget not below it (a larger budget wins later, so this errs towards the full step; above every measured
    budget, the largest), and among them the row of the largest measured batch not above ``batch`` (the
    crossover only falls as the batch grows); a budget without such a row takes the next larger budget's rows.
    0 for ``full`` or a policy without measurements, :data:`NEVER` where the sparse step never won."""
    name = getattr(policy, "name", policy)
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    rows = table()["policies"].get(name)
    if not rows:
        return 0
    measured = table()["budget"]
    budget = budget if budget is not None else budget_of(policy)
    budget = measured if budget is None else budget
    by_budget: dict[int, list[dict]] = {}
    for r in rows:
        by_budget.setdefault(r.get("budget", measured), []).append(r)
    for b in sorted(b for b in by_budget if b >= budget) or [max(by_budget)]:
        fits = [r for r in by_budget[b] if r["from_batch"] <= batch]
        if fits:
            row = max(fits, key=lambda r: r["from_batch"])
            return NEVER if row["min_context"] is None else int(row["min_context"])
    return NEVER
