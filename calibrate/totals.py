"""Calibration statistics kept as sums and counts, so that any split of the traces merges back exactly.

Means are taken only at the end (:meth:`CalibrationTotals.means`): merging two halves of a run, or reducing
over the processes of ``accelerate launch`` with an all-reduce SUM, gives the same numbers as one pass.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

_F64 = torch.float64


@dataclass
class CalibrationTotals:
    """Sums (float64) and counts over sampled queries. L = layers, Hq = query heads, B = decode-time bins."""

    shift_sum: torch.Tensor  # [L]  Σ 1 − cos(a[l−1], a[l]); layer 0 stays 0
    shift_count: torch.Tensor  # [L]
    hoyer_sum: torch.Tensor  # [L, Hq, B]  Σ Hoyer sparsity per head and bin
    hoyer_count: torch.Tensor  # [L, B]
    position_sum: torch.Tensor  # [B]  Σ query position per bin (to label the time axis in tokens)
    position_count: torch.Tensor  # [B]
    drift_sum: torch.Tensor  # [L]  Σ cos(a_l at query t, a_l at the next sampled query of the same trace)
    drift_count: torch.Tensor  # [L]
    recall_sum: torch.Tensor  # [L, L]  Σ recall of layer l (column) on the pages chosen by layer s (row)
    recall_count: torch.Tensor  # []
    traces: torch.Tensor  # []  traces recorded
    tokens: torch.Tensor  # []  tokens run through the model

    @classmethod
    def zeros(cls, layers: int, heads: int, bins: int, device: torch.device | str = "cpu") -> CalibrationTotals:
        if min(layers, heads, bins) < 1:
            raise ValueError(f"layers, heads and bins must be ≥ 1, got {layers}, {heads}, {bins}")
        z = lambda *shape: torch.zeros(*shape, dtype=_F64, device=device)  # noqa: E731
        return cls(z(layers), z(layers), z(layers, heads, bins), z(layers, bins), z(bins), z(bins), z(layers),
                   z(layers), z(layers, layers), z(()), z(()), z(()))

    @property
    def num_layers(self) -> int:
        return self.shift_sum.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to(self, device: torch.device | str) -> CalibrationTotals:
        return CalibrationTotals(**{k: v.to(device) for k, v in self.tensors().items()})

    def merge(self, other: CalibrationTotals) -> CalibrationTotals:
        """Elementwise sum of two runs' totals (shapes must agree)."""
        mine, theirs = self.tensors(), other.tensors()
        for k, v in mine.items():
            if v.shape != theirs[k].shape:
                raise ValueError(f"cannot merge totals: {k} has shape {tuple(v.shape)} here and "
                                 f"{tuple(theirs[k].shape)} there; both runs need the same model and bins")
        return CalibrationTotals(**{k: v + theirs[k].to(v.device) for k, v in mine.items()})

    def all_reduce(self) -> CalibrationTotals:
        """Sum over the processes of an initialised ``torch.distributed`` group (no-op without one)."""
        from rolecall.core.distributed import all_reduce_sum_

        out = {k: v.clone() for k, v in self.tensors().items()}
        all_reduce_sum_(out.values())
        return CalibrationTotals(**out)

    def means(self) -> dict[str, torch.Tensor]:
        """Per-layer means, float32 on the CPU.

        ``shift [L]``, ``sparsity [L, B]`` (mean over heads and queries; a bin without queries gets the layer's
        overall mean), ``head_sparsity [L, Hq]``, ``drift [L]``, ``recall [L, L]``, ``positions [B]``.
        """
        t = {k: v.detach().double().cpu() for k, v in self.tensors().items()}
        div = lambda s, c: s / c.clamp_min(1)  # noqa: E731
        heads = t["hoyer_sum"].shape[1]
        per_bin = div(t["hoyer_sum"].sum(1), t["hoyer_count"] * heads)  # [L, B]
        overall = div(t["hoyer_sum"].sum((1, 2)), t["hoyer_count"].sum(1) * heads)  # [L]
        per_bin = torch.where(t["hoyer_count"] > 0, per_bin, overall[:, None])
        head = div(t["hoyer_sum"].sum(2), t["hoyer_count"].sum(1)[:, None])  # [L, Hq]
        out = {
            "shift": div(t["shift_sum"], t["shift_count"]),
            "sparsity": per_bin,
            "layer_sparsity": overall,
            "head_sparsity": head,
            "drift": div(t["drift_sum"], t["drift_count"]),
            "recall": div(t["recall_sum"], t["recall_count"]),
            "positions": div(t["position_sum"], t["position_count"]),
        }
        return {k: v.float() for k, v in out.items()}
