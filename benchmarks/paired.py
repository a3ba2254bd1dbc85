"""At one budget, each policy's difference to full attention and to Quest over the same prompts, across grids:
a forest plot with the one-point band, a table and JSON.

    python -m benchmarks.paired --budget 1024 --out artifacts/paired \\
        --grid "SmolLM2-135M, 1K-8K=artifacts/smollm2-135m/ruler-grid-h200" \\
        --grid "SmolLM2-135M, 16K-32K=artifacts/smollm2-135m/ruler-long100-h200" \\
        --grid "Gemma-3-270M, 4K-32K=artifacts/gemma3-270m/ruler-grid"

``--grid NAME=FOLDER``: a folder written by ``benchmarks/quality.py`` (its ``summary.json`` keeps every row's
per-prompt scores), shown as one panel named NAME. In each, every row at ``--budget`` (or the ``--rows`` given,
in that order) is compared with the grid's full-attention row and with its Quest row at the same budget: the
mean per-prompt score difference in points with its 95 % interval (``rolecall.eval.stats.paired_difference``).
A row is *within one point* of full when that whole interval lies in [−1, +1]; *significant* when it excludes 0.
Writes ``paired.png``, ``paired.json`` and ``PAIRED.md`` (the table it prints).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from benchmarks.report import at_least, grid_summary, pairable_scores, save_figure, write_report
from rolecall.cli import Parser, run_reporting_errors
from rolecall.eval.stats import paired_difference

PROG = Path(__file__).name
BAND = 1.0  # points: "within one point of full"


def _shown(folder: str) -> str:
    """A folder as the JSON records it: relative to the working directory when under it (no machine's path)."""
    path = Path(folder).resolve()
    try:
        return path.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.name


def _points(a: list[float], b: list[float]) -> dict[str, Any]:
    d = paired_difference(a, b)
    lo, hi = (100 * x for x in d["interval"])
    return {"mean": 100 * d["mean"], "interval": [lo, hi], "n": d["n"], "significant": lo > 0 or hi < 0}


def compare(name: str, rows: list[dict[str, Any]], budget: int, labels: list[str] | None) -> dict[str, Any]:
    """One grid's comparison: per row at ``budget`` its score and its paired differences to full and to Quest."""
    full = next((r for r in rows if r["policy"] == "full" and pairable_scores(r)), None)
    if full is None:
        raise ValueError(f"--grid {name}: no full-attention row with per-prompt scores to compare against")
    at = {r["label"]: r for r in rows if r["budget"] == budget and pairable_scores(r)}
    if not at:
        have = sorted({r["budget"] for r in rows if r["budget"] is not None})
        raise ValueError(f"--grid {name}: no row at --budget {budget}; it has budgets {have}")
    quest = next((r for r in at.values() if r["policy"] == "quest"), None)
    if labels is None:
        picked = list(at)
    else:
        picked = [label for label in labels if label in at]  # a row another grid has is simply absent here
    out = []
    for label in picked:
        r = at[label]
        if len(r["scores"]) != len(full["scores"]):
            raise ValueError(f"--grid {name}: row {label} has {len(r['scores'])} prompts and full "
                             f"{len(full['scores'])}; a paired comparison needs the same prompts")
        vs_full = _points(r["scores"], full["scores"])
        vs_quest = None if quest is None or quest is r else _points(r["scores"], quest["scores"])
        out.append({"label": label, "policy": r["policy"], "score": r["score"]["score"], "prompts": len(r["scores"]),
                    "vs_full": vs_full, "vs_quest": vs_quest,
                    "within_one_point": vs_full["interval"][0] >= -BAND and vs_full["interval"][1] <= BAND})
    return {"name": name, "full_score": full["score"]["score"], "prompts": len(full["scores"]), "rows": out}


def _cell(d: dict[str, Any] | None) -> str:
    if d is None:
        return "–"
    lo, hi = d["interval"]
    return f"{d['mean']:+.1f} [{lo:+.1f}, {hi:+.1f}]" + (" *" if d["significant"] else "")


def format_table(grids: list[dict[str, Any]], budget: int) -> str:
    lines = [f"Paired differences at a {budget}-token budget, in points (95 % interval; * = excludes 0); "
             "'≤ 1' = the whole interval to full lies within one point.", ""]
    for g in grids:
        lines += [f"### {g['name']} (full attention {g['full_score']:.3f}, {g['prompts']} prompts)", "",
                  "| row | score | − full | ≤ 1 | − Quest |", "|---|---|---|---|---|"]
        for r in g["rows"]:
            lines.append(f"| {r['label']} | {r['score']:.3f} | {_cell(r['vs_full'])} | "
                         f"{'yes' if r['within_one_point'] else 'no'} | {_cell(r['vs_quest'])} |")
        lines.append("")
    return "\n".join(lines)


def plot(grids: list[dict[str, Any]], budget: int, path: Path) -> None:
    """One panel per grid: each row's difference to full with its interval, the ±1-point band shaded; rows
    within it filled, Quest in grey with a dotted line at its mean; the same rows on the same lines in every
    panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for g in grids for r in g["rows"]))
    fig, axes = plt.subplots(1, len(grids), figsize=(4.2 * len(grids), 0.32 * len(labels) + 1.6), sharey=True,
                             squeeze=False)
    for ax, g in zip(axes[0], grids):
        ax.axvspan(-BAND, BAND, color="tab:green", alpha=0.12, lw=0)
        ax.axvline(0, color="black", lw=0.8)
        quest = next((r for r in g["rows"] if r["policy"] == "quest"), None)
        if quest is not None:  # right of this line: ahead of Quest on average
            ax.axvline(quest["vs_full"]["mean"], color="grey", lw=0.8, ls=":")
        for r in g["rows"]:
            y, d = labels.index(r["label"]), r["vs_full"]
            color = "grey" if r["policy"] == "quest" else ("tab:green" if r["within_one_point"] else "tab:red")
            lo, hi = d["interval"]
            ax.errorbar(d["mean"], y, xerr=[[d["mean"] - lo], [hi - d["mean"]]], fmt="o", color=color, capsize=2,
                        ms=4, mfc=color if r["within_one_point"] else "white")
        ax.set_title(f"{g['name']}\nfull {g['full_score']:.3f}, {g['prompts']} prompts", fontsize=9)
        ax.set_xlabel("score − full attention (points, 95 %)", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(labels)), labels, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.suptitle(f"Paired difference to full attention at a {budget}-token budget (green band: ±{BAND:g} point; "
                 "filled: the interval lies inside it; grey, dotted: Quest)", fontsize=9)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", action="append", required=True, metavar="NAME=FOLDER",
                   help="a benchmarks/quality.py output folder and the name of its panel, repeatable")
    p.add_argument("--budget", type=int, default=1024, help="the budget compared (default 1024)")
    p.add_argument("--rows", nargs="+", default=None,
                   help="row labels to show, in this order (default: every row at the budget, in the grid's order)")
    p.add_argument("--out", required=True, help="output folder")
    args = p.parse_args(argv)
    p.check_writable(args.out, "--out", folder=True)
    bad = next((g for g in args.grid if "=" not in g or not g.split("=", 1)[0] or not g.split("=", 1)[1]), None)
    if bad is not None:
        p.error(f"--grid {bad!r}: write it as NAME=FOLDER, e.g. 'SmolLM2, 1K-8K=artifacts/smollm2-135m/ruler-grid-h200'")
    at_least(p, args, budget=1)
    return args


def run(args: argparse.Namespace) -> int:
    named = [g.split("=", 1) for g in args.grid]
    grids = [compare(name, grid_summary(folder, f"--grid {name}")["rows"], args.budget, args.rows)
             for name, folder in named]
    if not any(g["rows"] for g in grids):
        raise ValueError(f"--rows {' '.join(args.rows or [])}: none of them is a row at --budget {args.budget} "
                         "in these grids")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(grids, args.budget, out / "paired.png")
    sources = {name: _shown(folder) for name, folder in named}
    write_report(out, "paired", {"budget": args.budget, "band_points": BAND,
                                 "grids": [{**g, "folder": sources[g["name"]]} for g in grids]},
                 format_table(grids, args.budget))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Refusals in one line, exit status 2: bad flags from the parser, unusable grids from the run."""
    return run_reporting_errors(PROG, run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
