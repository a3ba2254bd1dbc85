"""Figures of a calibration manifest: shift curve with the Δ-layers, sparsity heatmap, recall per layer."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from rolecall.core.atomic import write_figure  # noqa: E402
from rolecall.core.manifest import RoleManifest  # noqa: E402

ROLE_COLORS = {0: "#7f7f7f", 1: "#d62728", 2: "#1f77b4"}
ROLE_NAMES = {0: "full (warm-up)", 1: "Δ (selection)", 2: "sparse"}


def _save(fig, path: Path) -> Path:
    write_figure(fig, path, dpi=150, bbox_inches="tight")
    return path


def _title(manifest: RoleManifest) -> str:
    name = manifest.model.name or "model"
    return f"{name} — {manifest.data.get('traces', '?')} traces, {manifest.metrics.get('sampled_queries', '?')} sampled queries"


def plot_shift(manifest: RoleManifest, path: Path) -> Path:
    shift = manifest.layer_shift.numpy()
    layers = range(len(shift))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(layers, shift, color="black", lw=1.2, marker="o", ms=3, label="mean shift 1 − cos(a[l−1], a[l])")
    warm = manifest.config.get("warmup", 0)
    if warm:
        ax.axvspan(-0.5, warm - 0.5, color=ROLE_COLORS[0], alpha=0.2, label="warm-up (full)")
    delta = manifest.delta_layers
    ax.scatter(delta, shift[delta], s=70, color=ROLE_COLORS[1], zorder=3,
               label=f"Δ-layers {delta} ({manifest.config.get('select', 'peaks')}, min gap {manifest.config.get('min_gap')})")
    for d in delta:
        ax.axvline(d, color=ROLE_COLORS[1], lw=0.6, ls="--")
    ax.set(xlabel="layer", ylabel="cosine shift", title=_title(manifest), xlim=(-0.5, len(shift) - 0.5))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    return _save(fig, path)


def plot_sparsity(manifest: RoleManifest, path: Path) -> Path:
    sparsity = manifest.layer_sparsity.numpy()  # [L, B]
    positions = manifest.metrics.get("bin_positions") or list(range(sparsity.shape[1]))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(8, 4), gridspec_kw={"width_ratios": [4, 1]}, sharey=True)
    im = ax.imshow(sparsity, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(len(positions)), [f"{p:.0f}" for p in positions], rotation=45, fontsize=7)
    ax.set(xlabel="decode-time bin (mean query position, tokens)", ylabel="layer", title="Hoyer sparsity")
    fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
    budget = manifest.layer_budget.numpy()
    bx.barh(range(len(budget)), budget, color="#2ca02c")
    bx.set(xlabel="Lethe budget\n(fraction kept)", title=f"mean {budget.mean():.2f}")
    bx.grid(alpha=0.3, axis="x")
    fig.suptitle(_title(manifest), fontsize=9)
    return _save(fig, path)


def plot_recall(manifest: RoleManifest, path: Path) -> Path:
    recall = manifest.metrics["recall_per_layer"]
    role = manifest.layer_role.tolist()
    cfg = manifest.config
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(range(len(recall)), recall, color=[ROLE_COLORS[r] for r in role])
    mean = manifest.metrics["recall_mean"]
    ax.axhline(mean, color="black", lw=0.8, ls="--")
    handles = [Patch(color=ROLE_COLORS[r], label=name) for r, name in ROLE_NAMES.items()]
    handles.append(Line2D([], [], color="black", lw=0.8, ls="--", label=f"mean over sparse layers {mean:.3f}"))
    ax.set(xlabel="layer", ylabel="attention recall", ylim=(min(0.5, min(recall) - 0.05), 1.01),
           title=f"simulated recall, Δ = {manifest.delta_layers}, K = {cfg.get('num_pages', cfg.get('top_pages'))} "
                 f"pages ({cfg.get('recent_pages')} recent) of {cfg.get('page_size')}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, frameon=False)
    return _save(fig, path)


def plot_all(manifest: RoleManifest, folder: str | os.PathLike, stem: str) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return [plot_shift(manifest, folder / f"{stem}.shift.png"),
            plot_sparsity(manifest, folder / f"{stem}.sparsity.png"),
            plot_recall(manifest, folder / f"{stem}.recall.png")]
