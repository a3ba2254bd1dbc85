"""A quality grid's figures: ``quality.png`` (score with its interval and KL against the budget, a line per
policy), ``quality-tasks.png`` (a panel per task) and, for the reasoning suite, ``fidelity.png``; each from the
``summary.json`` object :func:`rolecall.eval.grid.write_summary` writes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rolecall.core import atomic


def save_figure(fig: Any, path: Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> None:
    """A matplotlib figure laid out inside ``rect`` (figure fractions: left, bottom, right, top; the rest is kept
    for a figure legend) and written to ``path`` atomically (PNG, 120 dpi), then closed."""
    fig.tight_layout(rect=rect)
    atomic.write_figure(fig, path, dpi=120)


def _score_lines(ax, summary: dict[str, Any], pick) -> None:
    """One line per policy label of ``pick(row)`` (a pooled score or None) against the budget, with its
    interval as error bars; ``full`` as a dashed reference with its interval shaded."""
    by_label: dict[str, list[dict[str, Any]]] = {}
    for r in summary["rows"]:
        by_label.setdefault(r["label"], []).append(r)
    sparse = [label for label, rows in by_label.items() if rows[0]["budget"] is not None]
    for label, rows in by_label.items():
        if rows[0]["budget"] is None:
            cell = pick(rows[0])
            if cell is not None:
                ax.axhline(cell["score"], color="black", ls="--", lw=1, label=label)
                ax.axhspan(*cell["interval"], color="black", alpha=0.08)
            continue
        rows = [r for r in sorted(rows, key=lambda r: r["budget"]) if pick(r) is not None]
        if rows:
            y = [pick(r)["score"] for r in rows]
            err = [[v - pick(r)["interval"][0] for v, r in zip(y, rows)], [pick(r)["interval"][1] - v for v, r in zip(y, rows)]]
            dodge = 2 ** (0.06 * (sparse.index(label) - (len(sparse) - 1) / 2))  # side by side at a budget
            ax.errorbar([r["budget"] * dodge for r in rows], y, yerr=err, marker="o", capsize=3, label=label)
    ax.set_ylim(-0.05, 1.05)


def _budget_axis(ax, budgets: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.minorticks_off()
    ax.set_xlabel("budget (tokens)")
    ax.grid(alpha=0.3)


def _finish_pair(fig, left, right, summary: dict[str, Any], ylabels: tuple[str, str], title: str, path: Path,
                 log: tuple[bool, bool] = (False, True)) -> None:
    """Budget axes, y labels (log scale where asked), the legend on the left panel, the title; saved to ``path``."""
    for ax, label, logy in zip((left, right), ylabels, log):
        _budget_axis(ax, summary["budgets"])
        ax.set_ylabel(label)
        if logy:
            ax.set_yscale("log")
    left.legend(fontsize=8, frameon=False)
    fig.suptitle(f"{summary['model']}: {title}", fontsize=10)
    save_figure(fig, path)


def plot(summary: dict[str, Any], out: Path) -> list[str]:
    """``quality.png`` (score and KL against the budget) and, with several tasks, ``quality-tasks.png``;
    returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, kl_ax) = plt.subplots(1, 2, figsize=(11, 4))
    _score_lines(acc_ax, summary, lambda r: r.get("score"))
    for label in dict.fromkeys(r["label"] for r in summary["rows"]):
        rows = sorted((r for r in summary["rows"] if r["label"] == label and r["kl_mean"]), key=lambda r: r["budget"] or 0)
        if rows and rows[0]["budget"] is None:
            kl_ax.axhline(rows[0]["kl_mean"], color="black", ls="--", lw=1, label=label)
        elif rows:
            kl_ax.plot([r["budget"] for r in rows], [r["kl_mean"] for r in rows], marker="o", label=label)
    _finish_pair(fig, acc_ax, kl_ax, summary, ("score (Wilson 95 % bars)", "KL(full ‖ policy) per step"),
                 "quality against the token budget", out / "quality.png")
    written = ["quality.png"]
    tasks = sorted({t for r in summary["rows"] for t in r.get("tasks", {})})
    if len(tasks) > 1:
        plot_tasks(summary, tasks, out / "quality-tasks.png")
        written.append("quality-tasks.png")
    return written


def plot_tasks(summary: dict[str, Any], tasks: list[str], path: Path) -> None:
    """One panel per task (score with its interval against the budget, one line per policy) in one figure, the
    legend once below them."""
    import matplotlib.pyplot as plt

    columns = min(4, len(tasks))
    rows = math.ceil(len(tasks) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.6 * rows + 0.8), sharey=True, squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        _score_lines(ax, summary, lambda r, t=task: r.get("tasks", {}).get(t))
        _budget_axis(ax, summary["budgets"])
        ax.set_title(task, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.xaxis.label.set_size(8)
    for ax in axes.flat[len(tasks):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("score (Wilson 95 %)", fontsize=8)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8, frameon=False)
    fig.suptitle(f"{summary['model']}: each task against the token budget", fontsize=10)
    legend_rows = 1 + (len(labels) - 1) // 6
    save_figure(fig, path, rect=(0, 0.25 * legend_rows / (2.6 * rows + 0.8), 1, 1))


def plot_fidelity(summary: dict[str, Any], out: Path) -> list[str]:
    """``fidelity.png``: per-step KL (bootstrap bars) and top-1 agreement against the budget, one line a policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (kl_ax, top_ax) = plt.subplots(1, 2, figsize=(11, 4))
    labels = list(dict.fromkeys(r["label"] for r in summary["rows"] if r["budget"] is not None))
    for i, label in enumerate(labels):
        rows = sorted((r for r in summary["rows"] if r["label"] == label and r["kl_mean"] is not None),
                      key=lambda r: r["budget"])
        dodge = 2 ** (0.06 * (i - (len(labels) - 1) / 2))
        x = [r["budget"] * dodge for r in rows]
        y = [r["kl_mean"] for r in rows]
        err = [[v - (r["kl_interval"] or [v, v])[0] for v, r in zip(y, rows)],
               [(r["kl_interval"] or [v, v])[1] - v for v, r in zip(y, rows)]]
        kl_ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label)
        top_ax.plot(x, [r["top1_agreement"] for r in rows], marker="o", label=label)
    _finish_pair(fig, kl_ax, top_ax, summary, ("KL(full ‖ policy) per step (95 % bootstrap bars)",
                                               "top-1 agreement with full"),
                 "long generations against the token budget", out / "fidelity.png", log=(True, False))
    return ["fidelity.png"]
