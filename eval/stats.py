"""Intervals for evaluation figures: Wilson for a score, a paired normal interval for the difference of two
policies over the same prompts, a percentile bootstrap for a weighted mean over prompts."""

from __future__ import annotations

import math
from typing import Any

import torch


def wilson_interval(successes: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a proportion (95 % by default). A fractional ``successes`` (RULER's partial
    scores summed) is used as it is."""
    if n <= 0:
        raise ValueError(f"wilson_interval needs n >= 1, got {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(a: list[float], b: list[float], z: float = 1.959964) -> dict[str, float]:
    """Mean of ``a[i] − b[i]`` over the same prompts, with its normal 95 % interval (mean ± z·sd/√n). Pairing
    removes the prompts' own difficulty, so it separates two methods that unpaired intervals cannot."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_difference needs two equally long non-empty lists, got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    half = z * sd / math.sqrt(n)
    return {"mean": mean, "interval": [mean - half, mean + half], "n": n}


def bootstrap_interval(values: list[float], weights: list[float], reps: int = 2000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the weighted mean ``Σ w v / Σ w`` over resampled items (prompts: their
    steps are not independent, the prompts are). The same inputs give the same interval."""
    if not values or len(values) != len(weights):
        raise ValueError("bootstrap_interval needs one weight per value and at least one value")
    v, w = torch.tensor(values, dtype=torch.float64), torch.tensor(weights, dtype=torch.float64)
    picks = torch.randint(0, len(values), (reps, len(values)), generator=torch.Generator().manual_seed(seed))
    means = (v[picks] * w[picks]).sum(1) / w[picks].sum(1).clamp_min(1e-300)
    low, high = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return float(low), float(high)


def pooled(cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Cells ``{"score", "n"}`` pooled into one score with its count and Wilson 95 % interval (None: no prompts)."""
    n = sum(c["n"] for c in cells)
    if not n:
        return None
    total = sum(c["score"] * c["n"] for c in cells)
    return {"score": total / n, "n": n, "interval": list(wilson_interval(total, n))}
