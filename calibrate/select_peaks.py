"""Δ-layers at the peaks of the inter-layer shift curve (DELTA's rule)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rolecall.calibrate.delta import choose_delta_layers, mean_sparse_recall


@dataclass
class PeaksSelector:
    """Highest shift peaks, spread at least ``min_gap`` layers apart.

    With ``num_delta="auto"`` it takes peaks in order of height until the simulated recall of the sparse layers
    reaches ``target_recall`` (or every layer is a Δ-layer).
    """

    warmup: int = 2
    min_gap: int = 3
    target_recall: float = 0.9

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.min_gap < 1 or not 0 < self.target_recall <= 1:
            raise ValueError(f"peaks selector needs warmup ≥ 0, min_gap ≥ 1, target_recall in (0, 1]; got {self}")

    def __call__(self, shift: torch.Tensor, recall: torch.Tensor, num_delta: int | str) -> list[int]:
        """``shift [L]``, ``recall [L, L]`` (rows: selecting layer) → sorted Δ-layers."""
        if num_delta != "auto":
            return choose_delta_layers(shift.tolist(), int(num_delta), self.warmup, self.min_gap)
        for count in range(1, len(shift) - self.warmup + 1):
            chosen = choose_delta_layers(shift.tolist(), count, self.warmup, self.min_gap)
            if mean_sparse_recall(recall, chosen, self.warmup) >= self.target_recall:
                return chosen
        return chosen
