"""Accuracy against cost: each policy's quality-grid rows (one per budget) as a frontier, against the fraction of
keys it read and against its measured decode time per token.

    python -m benchmarks.frontier --grid artifacts/smollm2-135m/ruler-grid-h200 artifacts/smollm2-135m/ruler-budgets-h200 \\
        --decode benchmarks/results/decode_budgets_h200.json --context 32768 --batch 8 \\
        --out artifacts/smollm2-135m/frontier

``--grid``: folders written by ``benchmarks/quality.py`` (their ``summary.json``); a label and budget found in
several grids is taken from the one with the most prompts, and each point keeps its own Wilson 95 % interval.
Scores are pooled over every task and length of the grid, or one ``--task``. ``--decode``: a JSON of
``benchmarks/decode.py``; a row's cost is the TPOT of its decode case at the same budget, ``--context`` and
``--batch`` (several files may be given: one budget each, say; the case is the row's policy, ``delta-refine`` for ``refine`` > 1, ``vattention`` only for
vAttention on a DELTA manifest, as ``decode.py`` runs it; ``--case LABEL=CASE`` sets it by hand). Writes
``frontier.png``, ``frontier.json`` and prints the table.

``--reference LABEL`` (default quest, where the grids have it): every other budgeted row also gets its score minus the reference's at the
same fraction of keys read, the reference's rows interpolated linearly between the two budgets around it, with
a 95 % interval: paired over the prompts where the three rows come from one grid, else from their Wilson
intervals as independent errors; none outside the reference's measured range.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from benchmarks.report import at_least, grid_summary, read_report, save_figure, write_report
from rolecall.cli import Parser, run_reporting_errors
from rolecall.eval.stats import paired_difference

PROG = Path(__file__).name
Z = 1.959964


def load_rows(grids: list[str], task: str | None) -> list[dict[str, Any]]:
    """Rows of every grid, ``{label, policy, budget, params, manifest, score, interval, n, keys, prompts}``;
    where a (label, budget) repeats, the row with the most prompts."""
    best: dict[tuple[str, Any], dict[str, Any]] = {}
    tasks: set[str] = set()
    for folder in grids:
        for r in grid_summary(folder, "--grid")["rows"]:
            tasks.update(r.get("tasks") or {})
            cell = r["score"] if task is None else r.get("tasks", {}).get(task)
            if cell is None:
                continue
            row = {"label": r["label"], "policy": r["policy"], "budget": r["budget"], "params": r["params"],
                   "manifest": r["manifest"], "score": cell["score"], "interval": cell["interval"], "n": cell["n"],
                   "keys": r["attended_fraction"], "grid": Path(folder).name,
                   "scores": r.get("scores") if task is None else None}  # per prompt, for pairing
            key = (r["label"], r["budget"])
            if key not in best or best[key]["n"] < row["n"]:
                best[key] = row
    if not best:
        if task is not None:
            raise ValueError(f"--task {task}: no scored row of that task in {', '.join(grids)}; their tasks: "
                             f"{', '.join(sorted(tasks)) or 'none'}")
        raise ValueError(f"--grid {' '.join(grids)}: no scored rows in their summary.json; run the grid to the end "
                         "with benchmarks/quality.py first")
    return sorted(best.values(), key=lambda r: (r["label"], r["budget"] or 0))


def decode_case(row: dict[str, Any], cases: dict[str, str]) -> str | None:
    """The ``benchmarks/decode.py`` case that times ``row``'s policy, or None when it has none."""
    if row["label"] in cases:
        return cases[row["label"]]
    policy = row["policy"]
    if policy == "delta" and row["params"].get("refine", 1) > 1:
        return "delta-refine"
    if policy == "vattention":
        return "vattention" if row["manifest"] else None  # decode.py times vAttention on DELTA's roles
    return policy if policy in ("full", "delta", "quest", "lychee", "lethe") else None


def attach_tpot(rows: list[dict[str, Any]], decode: list[str], context: int, batch: int,
                cases: dict[str, str]) -> dict:
    """Sets each row's ``tpot_ms`` (None where no decode JSON has such a case; a later file's figure wins);
    returns the header of the first file."""
    files = [read_report(Path(f), "--decode", "give a JSON that benchmarks/decode.py wrote (its --out)")
             for f in decode]
    tpot = {(d["policy"], d["budget"]): d["tpot_ms"] for data in files for d in data["rows"]
            if d.get("context") == context and d.get("batch") == batch and "tpot_ms" in d}
    if not tpot:
        have = sorted({(d["context"], d["batch"]) for data in files for d in data["rows"]})
        raise ValueError(f"--decode {' '.join(decode)}: no rows at --context {context} --batch {batch}; "
                         f"they have {have}")
    data = files[0]
    for r in rows:
        case = decode_case(r, cases)
        r["tpot_ms"] = tpot.get((case, None if case == "full" else r["budget"])) if case else None
    return {"gpu": data.get("gpu"), "model": next(d["model"] for d in data["rows"]), "context": context, "batch": batch}


def _difference(r: dict[str, Any], lo: dict[str, Any], hi: dict[str, Any], w: float) -> dict[str, Any]:
    """``r``'s score minus ``w·lo + (1 − w)·hi``: paired over the prompts when the three rows come from one grid
    (the same prompts, each scored), otherwise from their Wilson half-widths as independent errors."""
    same = r["grid"] == lo["grid"] == hi["grid"] and all(x["scores"] for x in (r, lo, hi))
    if same and len(r["scores"]) == len(lo["scores"]) == len(hi["scores"]):
        keep = [i for i, t in enumerate(zip(r["scores"], lo["scores"], hi["scores"])) if None not in t]
        d = paired_difference([r["scores"][i] for i in keep],
                              [w * lo["scores"][i] + (1 - w) * hi["scores"][i] for i in keep])
        return {"mean": d["mean"], "interval": d["interval"], "paired": True}
    se = [(x["interval"][1] - x["interval"][0]) / (2 * Z) for x in (r, lo, hi)]
    mean = r["score"] - (w * lo["score"] + (1 - w) * hi["score"])
    half = Z * math.sqrt(se[0] ** 2 + (w * se[1]) ** 2 + ((1 - w) * se[2]) ** 2)
    return {"mean": mean, "interval": [mean - half, mean + half], "paired": False}


def equal_keys(rows: list[dict[str, Any]], reference: str) -> None:
    """Sets each budgeted row's ``vs_reference``: its score minus the ``reference`` label's at the same fraction
    of keys read, the reference's frontier interpolated linearly between the two budgets around it (None
    outside the reference's measured range: no extrapolation)."""
    ref = sorted((r for r in rows if r["label"] == reference and r["budget"] is not None), key=lambda r: r["keys"])
    for r in rows:
        r["vs_reference"] = None
        if r["label"] == reference or r["budget"] is None:
            continue
        for lo, hi in zip(ref, ref[1:] or ref):
            if lo["keys"] <= r["keys"] <= hi["keys"]:
                w = (hi["keys"] - r["keys"]) / (hi["keys"] - lo["keys"]) if hi["keys"] > lo["keys"] else 1.0
                r["vs_reference"] = {**_difference(r, lo, hi, w), "between": [lo["budget"], hi["budget"]]}
                break


def format_table(rows: list[dict[str, Any]], reference: str) -> str:
    lines = [f"| policy | budget | score (Wilson 95 %) | prompts | keys read | TPOT ms | − {reference} at equal keys |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["interval"]
        tpot = f"{r['tpot_ms']:.2f}" if r.get("tpot_ms") is not None else "–"
        d = r.get("vs_reference")
        vs = "–" if d is None else (f"{100 * d['mean']:+.1f} [{100 * d['interval'][0]:+.1f}, {100 * d['interval'][1]:+.1f}]"
                                    f"{' *' if d['interval'][0] > 0 or d['interval'][1] < 0 else ''}"
                                    f"{'' if d['paired'] else ' (unpaired)'}")
        lines.append(f"| {r['label']} | {r['budget'] or 'all'} | {r['score']:.3f} [{lo:.3f}, {hi:.3f}] | {r['n']} "
                     f"| {r['keys']:.3f} | {tpot} | {vs} |")
    return "\n".join(lines) + "\n"


def _panel(ax, rows: list[dict[str, Any]], x_key: str) -> None:
    """One line per label through its budgets, Wilson bars; full as a dashed line with its interval shaded."""
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in rows))
    colors = {label: plt.cm.tab20(i % 20) for i, label in enumerate(labels)}  # the same in both panels
    for label in labels:
        pts = [r for r in rows if r["label"] == label and r.get(x_key) is not None]
        if not pts:
            continue
        if pts[0]["budget"] is None:
            ax.axhline(pts[0]["score"], color="black", ls="--", lw=1, label=f"{label} (ceiling)")
            ax.axhspan(*pts[0]["interval"], color="black", alpha=0.08)
            ax.axvline(pts[0][x_key], color="black", ls=":", lw=1)  # full's own cost
            continue
        pts.sort(key=lambda r: r[x_key])
        y = [r["score"] for r in pts]
        err = [[v - r["interval"][0] for v, r in zip(y, pts)], [r["interval"][1] - v for v, r in zip(y, pts)]]
        ax.errorbar([r[x_key] for r in pts], y, yerr=err, marker="o", capsize=3, label=label, color=colors[label])
        for r in pts:
            ax.annotate(str(r["budget"]), (r[x_key], r["score"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points", color=colors[label])
    ax.grid(alpha=0.3)


def plot(rows: list[dict[str, Any]], header: dict | None, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if header else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    _panel(axes[0][0], rows, "keys")
    axes[0][0].set_xlabel("fraction of the context's keys read per step (labels: budget in tokens)")
    axes[0][0].set_ylabel("score (Wilson 95 % bars)")
    if header:
        _panel(axes[0][1], rows, "tpot_ms")
        axes[0][1].set_xlabel(f"TPOT on the engine, ms ({header['model']} shape, {header['context'] // 1024}K × "
                              f"{header['batch']}, {header['gpu']})")
    axes[0][0].legend(fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", nargs="+", required=True, help="benchmarks/quality.py output folders")
    p.add_argument("--task", default=None, help="one task of the suite (default: every task and length pooled)")
    p.add_argument("--decode", nargs="+", default=None, help="benchmarks/decode.py JSONs for the TPOT panel")
    p.add_argument("--context", type=int, default=32768, help="context of the decode rows used (default 32768)")
    p.add_argument("--batch", type=int, default=8, help="batch of the decode rows used (default 8)")
    p.add_argument("--case", action="append", default=[], metavar="LABEL=CASE",
                   help="decode.py case timing a row label, repeatable (defaults: see the module docstring)")
    p.add_argument("--reference", default=None,
                   help="the label whose frontier every other row is compared with at equal keys read (default quest, "
                   "where the grids have it)")
    p.add_argument("--out", required=True, help="output folder")
    args = p.parse_args(argv)
    p.check_writable(args.out, "--out", folder=True)
    at_least(p, args, context=1, batch=1)
    bad = [c for c in args.case if "=" not in c]
    if bad:
        p.error(f"--case {bad[0]!r}: expected LABEL=CASE, e.g. lychee-hardkuma=lychee")
    args.cases = dict(c.split("=", 1) for c in args.case)
    return args


def run(args: argparse.Namespace) -> int:
    rows = load_rows(args.grid, args.task)
    header = attach_tpot(rows, args.decode, args.context, args.batch, args.cases) if args.decode else None
    labels = {r["label"] for r in rows if r["budget"] is not None}
    if args.reference is not None and args.reference not in labels:
        raise ValueError(f"--reference {args.reference}: no row of that label with a budget in the grids; choose "
                         f"from {', '.join(sorted(labels))}")
    args.reference = args.reference or "quest"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = grid_summary(args.grid[0], "--grid").get("model")
    plot(rows, header, f"{model}: {args.task or 'all tasks and lengths'}, score against cost", out / "frontier.png")
    equal_keys(rows, args.reference)
    for r in rows:
        r.pop("scores")
    write_report(out, "frontier", {"task": args.task, "decode": header, "reference": args.reference, "rows": rows},
                 format_table(rows, args.reference))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Refusals in one line, exit status 2: bad flags from the parser, unusable grids and decode files from the
    run."""
    return run_reporting_errors(PROG, run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
