"""Lethe's per-layer budgets from the recorded sparsity profile.

Allocation rule: a layer's attention density is ``1 − s̄_l``, with ``s̄_l`` its mean Hoyer sparsity over the
decode-time bins. A dense layer spreads its mass over many tokens (little redundancy, evicting hurts it), a
sparse layer concentrates on few (much redundancy). Budgets are proportional to density,
``b_l = clip(c · (1 − s̄_l), min_budget, 1)``, with the one constant ``c`` (found by bisection; the clipped
sum is monotone in c) that makes the mean budget over layers equal ``budget``. Budgets are fractions of the
context a layer keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LetheBudget:
    """Density-proportional budgets with mean ``budget`` and floor ``min_budget``."""

    budget: float = 0.25
    min_budget: float = 0.02

    def __post_init__(self) -> None:
        if not 0 < self.budget <= 1:
            raise ValueError(f"Lethe budget must be a fraction in (0, 1], got {self.budget}")
        if not 0 <= self.min_budget <= self.budget:
            raise ValueError(f"Lethe min_budget must be in [0, budget={self.budget}], got {self.min_budget}")

    def __call__(self, sparsity: torch.Tensor) -> torch.Tensor:
        """``sparsity [L, B]`` (or ``[L]``) mean Hoyer sparsity → float32 budgets ``[L]``."""
        s = sparsity.double()
        if s.dim() == 2:
            s = s.mean(1)
        density = (1.0 - s).clamp(0.0, 1.0)  # [L]
        if float(density.sum()) <= 0.0:
            return torch.full_like(density, self.budget).float()

        def mean_at(c: float) -> torch.Tensor:
            return (c * density).clamp(self.min_budget, 1.0)

        lo, hi = 0.0, 1.0 / float(density[density > 0].min())  # at hi every dense layer keeps everything
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            if float(mean_at(mid).mean()) < self.budget:
                lo = mid
            else:
                hi = mid
        return mean_at(hi).float()
