"""Δ-layer choice: layer roles from the shift curve, and the simulated recall of any Δ-layer set.

Roles (as in ``rolecall.core.manifest``): layers ``[0, warmup)`` are full (warm-up), the Δ-layers run full attention
and choose pages, every other layer is sparse and reads the pages chosen by the nearest earlier Δ-layer.
Selectors (strategies that pick the Δ set) are found by name in ``SELECTORS``.

Hybrid models: sliding-window layers run their own attention at decode time, so they are not candidates.
:func:`select_among` runs a selector on the candidate layers only (the shift curve, the recall matrix and the
warm-up restricted to them, ``min_gap`` counted in candidate layers) and maps the choice back to layer indices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from scipy.signal import find_peaks

from rolecall.core.manifest import LAYER_ROLE_FULL, LAYER_ROLE_SELECT, LAYER_ROLE_SPARSE
from rolecall.core.registry import Registry

# name -> "module:class"; imported on use so each strategy stays in its own file
SELECTORS = Registry("Δ-layer selector")
SELECTORS.update({"peaks": "rolecall.calibrate.select_peaks:PeaksSelector", "recall": "rolecall.calibrate.select_recall:RecallSelector"})


def get_selector(name: str, **kwargs):
    """The selector registered as ``name``, built with ``kwargs``."""
    return SELECTORS.lookup(name)(**kwargs)


def check_delta_count(num_layers: int, num_delta: int, warmup: int) -> None:
    if warmup < 0 or warmup >= num_layers:
        raise ValueError(f"warmup must be in [0, {num_layers - 1}] for a {num_layers}-layer model, got {warmup}")
    if not 1 <= num_delta <= num_layers - warmup:
        raise ValueError(f"num_delta must be in [1, {num_layers - warmup}] for {num_layers} layers with warm-up "
                         f"{warmup}, got {num_delta}")


def choose_delta_layers(shift: Sequence[float], num_delta: int, warmup: int = 2, min_gap: int = 3) -> list[int]:
    """DELTA's Δ-layers from the mean shift curve ``shift[l] = 1 − cos(a[l−1], a[l])``, ``[L]``.

    Layer ``warmup`` is always the first Δ-layer (the first layer after the full warm-up layers must choose
    pages for the ones after it). The other ``num_delta − 1`` are the highest peaks of the curve after it,
    found with ``scipy.signal.find_peaks(distance=min_gap)`` so they spread over depth, and at least
    ``min_gap`` layers after ``warmup``. The last layer can be a peak (the curve is padded at the ends).
    Should there be too few peaks, the highest remaining layers fill up, keeping the gap where possible.
    Returns sorted layer indices.
    """
    curve = np.asarray(shift, dtype=np.float64)
    check_delta_count(len(curve), num_delta, warmup)
    if min_gap < 1:
        raise ValueError(f"min_gap must be ≥ 1, got {min_gap}")
    chosen = [warmup]
    tail = curve[warmup + 1 :]
    if num_delta == 1 or len(tail) == 0:
        return chosen
    low = tail.min() - 1.0
    peaks, _ = find_peaks(np.concatenate([[low], tail, [low]]), distance=min_gap)
    peaks = [int(p) - 1 + warmup + 1 for p in peaks]
    by_height = sorted(range(warmup + 1, len(curve)), key=lambda i: (-curve[i], i))
    candidates = sorted(peaks, key=lambda i: (-curve[i], i))
    for pool, gap in ((candidates, min_gap), (by_height, min_gap), (by_height, 1)):
        for layer in pool:
            if len(chosen) == num_delta:
                break
            if all(abs(layer - c) >= gap for c in chosen):
                chosen.append(layer)
    return sorted(chosen)


def select_among(selector, shift: torch.Tensor, recall: torch.Tensor, num_delta: int | str,
                 candidates: Sequence[int]) -> list[int]:
    """Run ``selector`` on the ``candidates`` layers only; returns layer indices.

    ``shift [L]``, ``recall [L, L]``; the selector's ``warmup`` counts layers, so it becomes the number of
    candidates below it (the first candidate at or after ``warmup`` is the first Δ-layer).
    """
    idx = torch.as_tensor(list(candidates), dtype=torch.long)
    warmup = int((idx < selector.warmup).sum())
    if warmup >= len(idx):
        raise ValueError(f"warmup={selector.warmup} leaves no full-attention layer to select (candidates "
                         f"{idx.tolist()}); lower --warmup")
    inner = type(selector)(**{**vars(selector), "warmup": warmup})
    chosen = inner(shift[idx], recall[idx][:, idx], num_delta)
    return [int(idx[i]) for i in chosen]


def candidate_recall(recall: torch.Tensor, candidates: Sequence[int]) -> torch.Tensor:
    """The ``[C, C]`` block of ``recall [L, L]`` between the candidate layers."""
    idx = torch.as_tensor(list(candidates), dtype=torch.long)
    return recall[idx][:, idx]


def layer_roles(num_layers: int, delta_layers: Sequence[int], warmup: int,
                sliding: Sequence[int] = ()) -> torch.Tensor:
    """int8 ``[L]``: 0 for the warm-up layers, 1 for the Δ-layers, 2 for the sparse rest; ``sliding`` layers
    (not candidates) are 0: they keep their own attention and neither choose nor read pages."""
    role = torch.full((num_layers,), LAYER_ROLE_SPARSE, dtype=torch.int8)
    role[:warmup] = LAYER_ROLE_FULL
    role[list(sliding)] = LAYER_ROLE_FULL
    role[list(delta_layers)] = LAYER_ROLE_SELECT
    return role


def recall_per_layer(recall: torch.Tensor, delta_layers: Sequence[int], warmup: int) -> torch.Tensor:
    """Simulated recall of each layer under a Δ set: ``recall [L, L]`` (mean recall of layer l on the pages
    chosen by layer s, rows s) → ``[L]``; 1 for full and Δ-layers, ``recall[s, l]`` for a sparse layer l whose
    nearest earlier Δ-layer is s."""
    num_layers = recall.shape[0]
    delta = sorted(delta_layers)
    if not delta or delta[0] > warmup or any(d < warmup for d in delta):
        raise ValueError(f"Δ-layers {delta} must start at the first layer after the warm-up ({warmup})")
    out = torch.ones(num_layers, dtype=recall.dtype)
    for layer in range(warmup, num_layers):
        if layer not in delta:
            source = max(d for d in delta if d < layer)
            out[layer] = recall[source, layer]
    return out


def mean_sparse_recall(recall: torch.Tensor, delta_layers: Sequence[int], warmup: int) -> float:
    """Mean simulated recall over the sparse layers (1.0 when no layer is sparse)."""
    per_layer = recall_per_layer(recall, delta_layers, warmup)
    sparse = [i for i in range(warmup, recall.shape[0]) if i not in set(delta_layers)]
    return float(per_layer[sparse].mean()) if sparse else 1.0
