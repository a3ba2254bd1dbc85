"""One picture of a manifest: role map, and where present the shift curve, sparsity heatmap and gate means."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from rolecall.core.atomic import write_figure
from rolecall.core.manifest import LAYER_ROLE_FULL, LAYER_ROLE_SELECT, RoleManifest

# panel -> the manifest tensor it draws; a panel appears when its tensor is present
PANELS = [("layers", "layer_role"), ("shift", "layer_shift"), ("sparsity", "layer_sparsity"),
          ("budget", "layer_budget"), ("heads", "head_role"), ("gate_mean", "head_expected_gate")]
ROLE_COLORS = {LAYER_ROLE_FULL: "#4c72b0", LAYER_ROLE_SELECT: "#dd8452", 2: "#d0d0d0"}
SLIDING_COLOR = "#8fbf8f"  # sliding-window layers (hybrid models): their own attention under every policy


def plot_manifest(manifest: RoleManifest, path: str | os.PathLike) -> Path:
    """Draw every present section of ``manifest`` into one PNG (written atomically) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [panel for panel, attr in PANELS if getattr(manifest, attr) is not None]
    if not panels:
        raise ValueError("the manifest has no sections to plot")

    L = manifest.model.num_layers
    layers = np.arange(L)
    sliding = sorted(manifest.model.sliding_layers or [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(7.0, 0.22 * L + 2), 2.3 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        DRAW[panel](fig, ax, manifest, layers, sliding)
        if panel != "sparsity":  # the sparsity panel's x axis is decode time, not layers
            ax.set_xlim(-0.6, L - 0.4)
            ax.set_xticks(layers[:: max(1, L // 16)])
    axes[-1, 0].set_xlabel("layer")
    fig.suptitle(f"{manifest.model.name or 'manifest'} — {L} layers × {manifest.model.num_kv_heads} KV heads", fontsize=11)
    fig.tight_layout()

    return write_figure(fig, path, dpi=130)


def _draw_layers(fig, ax, manifest: RoleManifest, layers: np.ndarray, sliding: list[int]) -> None:
    from matplotlib.patches import Patch

    roles = manifest.layer_role.numpy()
    colors = [SLIDING_COLOR if i in sliding else ROLE_COLORS[int(r)] for i, r in enumerate(roles)]
    ax.bar(layers, np.ones(len(layers)), color=colors, width=0.9)
    ax.set_yticks([])
    ax.set_title("layer roles")
    handles = [Patch(color=ROLE_COLORS[0], label="full (warm-up)"),
               Patch(color=ROLE_COLORS[1], label="Δ (selection)"), Patch(color=ROLE_COLORS[2], label="sparse")]
    if sliding:
        handles.append(Patch(color=SLIDING_COLOR, label="sliding window"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(handles),
              frameon=False, fontsize=8)


def _draw_shift(fig, ax, manifest: RoleManifest, layers: np.ndarray, sliding: list[int]) -> None:
    shift = manifest.layer_shift.numpy()
    # unless calibrated with include_sliding, the curve joins consecutive full-attention layers only
    skipped = [] if manifest.config.get("include_sliding") else sliding
    drawn = np.array([i for i in layers if i not in set(skipped)])
    ax.plot(drawn, shift[drawn], marker="o", ms=3, color="#333333", lw=1.2)
    delta = manifest.delta_layers
    if skipped:
        ax.scatter(skipped, np.zeros(len(skipped)), s=18, marker="x", color=SLIDING_COLOR, zorder=3,
                   label="sliding window (not recorded)")
    if delta:
        ax.scatter(delta, shift[delta], s=60, color=ROLE_COLORS[1], zorder=3, label="Δ-layers")
    if delta or skipped:
        ax.legend(fontsize=8, frameon=False)
    ax.set_ylabel("1 − cos(a[prev], a[l])" if skipped else "1 − cos(a[l−1], a[l])")
    ax.set_title("inter-layer attention shift")


def _draw_sparsity(fig, ax, manifest: RoleManifest, layers: np.ndarray, sliding: list[int]) -> None:
    im = ax.imshow(manifest.layer_sparsity.numpy(), aspect="auto", origin="lower", cmap="viridis",
                   interpolation="nearest", vmin=0.0, vmax=1.0)
    fig.colorbar(im, ax=ax, pad=0.01, label="Hoyer sparsity")
    ax.set_ylabel("layer")
    ax.set_xlabel("decode-time bin")
    ax.set_title("attention sparsity per layer over decode time")


def _draw_budget(fig, ax, manifest: RoleManifest, layers: np.ndarray, sliding: list[int]) -> None:
    ax.bar(layers, manifest.layer_budget.numpy(), width=0.9,
           color=[SLIDING_COLOR if i in sliding else "#55a868" for i in layers])  # sliding: their window
    ax.set_ylabel("kept fraction")
    ax.set_title("per-layer KV budget (Lethe)")


def _draw_heads(fig, ax, manifest: RoleManifest, layers: np.ndarray, sliding: list[int]) -> None:
    values = manifest.head_expected_gate if manifest.head_expected_gate is not None else manifest.head_role
    im = ax.imshow(values.numpy().T.astype(float), aspect="auto", origin="lower", cmap="magma",
                   vmin=0.0, vmax=1.0, interpolation="nearest")
    rl, rh = np.nonzero(manifest.head_role.numpy())
    ax.scatter(rl, rh, marker="s", s=14, facecolors="none", edgecolors="#00c0ff", lw=0.8)
    for i in sliding:  # hatched: gates held open, the layer keeps its own attention
        ax.axvspan(i - 0.5, i + 0.5, facecolor="none", edgecolor=SLIDING_COLOR, hatch="///", lw=0)
    fig.colorbar(im, ax=ax, pad=0.01, label="E[z]" if manifest.head_expected_gate is not None else "role")
    ax.set_ylabel("KV head")
    ax.set_title(f"head roles: {len(rl)} retrieval (outlined) of {manifest.head_role.numel()} KV heads")
    ax.set_yticks(np.arange(manifest.model.num_kv_heads))


def _draw_gate_mean(fig, ax, manifest: RoleManifest, layers: np.ndarray, sliding: list[int]) -> None:
    ax.bar(layers, manifest.head_expected_gate.numpy().mean(axis=1), color="#8172b3", width=0.9)
    ax.axhline(0.5, color="#888888", lw=0.8, ls="--")
    ax.set_ylim(0, 1)
    ax.set_ylabel("mean E[z]")
    ax.set_title("gate mean per layer")


DRAW = {"layers": _draw_layers, "shift": _draw_shift, "sparsity": _draw_sparsity, "budget": _draw_budget,
        "heads": _draw_heads, "gate_mean": _draw_gate_mean}  # one drawing function per panel of PANELS
