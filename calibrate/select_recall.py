"""Δ-layers chosen greedily for the simulated attention recall of the sparse layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rolecall.calibrate.delta import check_delta_count, mean_sparse_recall


@dataclass
class RecallSelector:
    """Start from ``[warmup]``; repeatedly add the layer that raises the mean simulated recall of the sparse
    layers the most (ties: the shallower layer). The recall of a set comes from the recorded pair matrix, so
    the search never re-runs the model.

    ``num_delta="auto"`` stops at the smallest set whose recall reaches ``target_recall``. ``shift`` is unused;
    it is accepted so all selectors share one call.
    """

    warmup: int = 2
    min_gap: int = 1  # unused by the search (recall already penalises neighbours); kept for a uniform config
    target_recall: float = 0.9

    def __post_init__(self) -> None:
        if self.warmup < 0 or not 0 < self.target_recall <= 1:
            raise ValueError(f"recall selector needs warmup ≥ 0 and target_recall in (0, 1]; got {self}")

    def __call__(self, shift: torch.Tensor, recall: torch.Tensor, num_delta: int | str) -> list[int]:
        num_layers = recall.shape[0]
        auto = num_delta == "auto"
        limit = num_layers - self.warmup if auto else int(num_delta)
        check_delta_count(num_layers, limit, self.warmup)
        chosen = [self.warmup]
        while len(chosen) < limit:
            if auto and mean_sparse_recall(recall, chosen, self.warmup) >= self.target_recall:
                break
            best = max((mean_sparse_recall(recall, sorted([*chosen, c]), self.warmup), -c)
                       for c in range(self.warmup + 1, num_layers) if c not in chosen)
            chosen = sorted([*chosen, -best[1]])
        return chosen
