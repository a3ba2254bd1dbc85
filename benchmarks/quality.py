"""Quality of every decode policy at a grid of token budgets, for one model: tables, plots, JSON.

    python -m benchmarks.quality --model smollm2-135m --alphabet digits --passkey-words 5 \\
        --delta artifacts/smollm2-135m/smollm2-135m.delta.safetensors \\
        --heads hardkuma=artifacts/smollm2-135m/heads.safetensors \\
        --lethe artifacts/smollm2-135m/smollm2-135m.delta.safetensors --out results/quality-smollm2

Every (policy, budget) cell runs ``rolecall.eval.evaluate`` on the same prompts (the passkey grid, lengths ×
depths × samples, or with ``--suite ruler`` the RULER-style suite, tasks × lengths × samples; built once)
and gets one JSON file in ``--out/cells/``, written atomically as soon as the cell is done. On a GPU the cells
still to run go through the batches together (``rolecall.eval.evaluate_many``): each batch is prefilled once for
all of them, most of the time at long contexts; their files are written when all are done, and each keeps its
finished batches in ``cells/<cell>.partial.jsonl`` meanwhile. A second run with
the same settings skips the cells whose file exists, so a killed run continues where it stopped; a cell made
with other settings is refused rather than mixed in. Once every cell is done they are packed, sorted by name, into
``cells.jsonl.xz`` (xz, one JSON line per cell); a folder with that file and no ``cells/`` (a grid kept as its
record) is summarised from it, and unpacked into ``cells/`` before a new cell runs. At the end it writes ``summary.json``, ``TABLE.md`` (also
printed; every score with its Wilson 95 % interval and sample count), ``quality.png`` (score with interval
bars and KL against the budget, one line per policy), with the suite ``quality-tasks.png`` (a panel per task), and
appends the command line to ``COMMAND.txt`` (unless it is already the last line there).

``--suite reasoning`` measures long generations instead (``rolecall.eval.fidelity``): on reasoning prompts,
full attention's own greedy trace with each policy fed the same tokens; every cell reports the per-step KL
with its bootstrap interval over prompts, top-1 agreement and the divergence point (engine policies only).

A budget is a token count; how it becomes each policy's own parameters is ``MAPPING`` (written into the
table). ``full`` does not depend on it and runs once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from benchmarks.report import at_least, pairable_scores, save_figure
from rolecall.cli import Parser, run_reporting_errors
from rolecall.cli.common import (
    add_prompt_arguments,
    check_policy,
    check_prompt_arguments,
    eval_settings,
)
from rolecall.core import atomic
from rolecall.core.models import DEFAULT_MODEL
from rolecall.eval import EvalSettings, evaluate, paired_difference, suite_prompts, wilson_interval
from rolecall.eval.budgets import MAPPING, policy_params
from rolecall.runtime.policies import PolicyError, engine_policies, get_policy

PROG = Path(__file__).name
ARCHIVE = "cells.jsonl.xz"  # a finished grid's cells in one file, the record ``artifacts/`` keeps
POLICIES = ("full", "delta", "lychee", "lethe", "vattention", "quest")
BUDGETS = (256, 512, 1024, 2048)
@dataclass
class Cell:
    label: str  # the table row: "delta", "delta-recall", "lychee-hardkuma", ...
    policy: str
    manifest: str | None
    budget: int | None  # None: full, which has no budget
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.label if self.budget is None else f"{self.label}-b{self.budget}"


def parse_heads(pairs: list[str] | None) -> list[tuple[str, str]]:
    heads = []
    for pair in pairs or []:
        name, sep, path = pair.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not path:
            raise ValueError(f"--heads {pair!r}: write it as NAME=PATH with NAME made of letters, digits, '_', '-', "
                             "e.g. --heads hardkuma=artifacts/m/heads.safetensors")
        heads.append((name, path))
    return heads


def parse_variants(specs: list[str] | None) -> list[tuple[str, dict[str, Any], str]]:
    """``--variant delta:per_head=true,num_pages=32`` → ``("delta", {"per_head": True, ...}, "-per_head-num_pages32")``:
    extra rows of a policy with these parameters on top of the budget's."""
    from rolecall.cli.common import parse_params

    out = []
    for spec in specs or []:
        policy, sep, pairs = spec.partition(":")
        if not sep or policy not in POLICIES or not pairs:
            raise ValueError(f"--variant {spec!r}: write it as POLICY:KEY=VALUE[,KEY=VALUE], POLICY one of "
                             f"{', '.join(POLICIES)}, e.g. --variant delta:per_head=true")
        try:
            extra = parse_params(pairs.split(","))
        except ValueError as e:
            raise ValueError(f"--variant {spec!r}: {e}") from None
        suffix = "".join(f"-{k}" if v is True else f"-{k}{v}" for k, v in extra.items())
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", suffix):
            raise ValueError(f"--variant {spec!r}: values must be letters, digits, '_', '.' or '-' (they name files)")
        out.append((policy, extra, suffix))
    return out


def build_cells(args: argparse.Namespace) -> list[Cell]:
    """The grid, in table order; a policy asked for by name without the manifest it needs is an error."""
    heads = parse_heads(args.heads)
    engine = engine_policies() if args.suite == "reasoning" else POLICIES
    have = {"full": True, "delta": bool(args.delta or args.delta_recall), "lychee": bool(heads), "lethe": True,
            "vattention": True, "quest": True}
    wanted = args.policies or [p for p in POLICIES if have[p] and p in engine]
    off = [p for p in wanted if p in POLICIES and p not in engine]
    if off:
        raise ValueError(f"--suite reasoning runs on the engine: leave {' and '.join(off)} out of --policies")
    if args.combined and not ("vattention" in wanted and (args.delta or args.delta_recall)):
        raise ValueError("--combined runs vAttention on a DELTA manifest: give --delta (or --delta-recall) and keep "
                         "vattention in --policies")
    for p in wanted:
        if p not in POLICIES:
            raise ValueError(f"--policies: unknown policy {p!r}; choose from {', '.join(POLICIES)}")
        if not have[p]:
            flag = {"delta": "--delta (or --delta-recall)", "lychee": "--heads NAME=PATH"}[p]
            raise ValueError(f"policy {p} needs {flag}; give the manifest or leave {p} out of --policies")
    base: list[tuple[str, str, str | None]] = []
    for p in POLICIES:
        if p not in wanted:
            continue
        if p == "delta":
            base += [(label, p, path) for label, path in (("delta", args.delta), ("delta-recall", args.delta_recall))
                     if path]
        elif p == "lychee":
            base += [(f"lychee-{name}", p, path) for name, path in heads]
        elif p == "vattention":  # --combined: also DELTA + vAttention on each DELTA manifest
            base.append((p, p, None))
            if args.combined:
                base += [(f"vattention-{label}", p, path) for label, path in
                         (("delta", args.delta), ("delta-recall", args.delta_recall)) if path]
        else:
            base.append((p, p, args.lethe if p == "lethe" else None))
    rows: list[tuple[str, str, str | None, dict[str, Any]]] = []
    variants = parse_variants(args.variant)
    for label, policy, manifest in base:  # each base row, then its variants
        rows.append((label, policy, manifest, {}))
        rows += [(label + suffix, policy, manifest, extra) for p, extra, suffix in variants if p == policy]
    cells = []
    for label, policy, manifest, extra in rows:
        if policy == "full":
            cells.append(Cell(label, policy, manifest, None))
            continue
        cells += [Cell(label, policy, manifest, b, {**policy_params(policy, b, args.vattention_epsilon, args.vattention_delta), **extra}) for b in args.budgets]
    for cell in cells:
        try:
            get_policy(cell.policy, **cell.params)  # bad values fail here, before the model loads
        except PolicyError as e:
            raise ValueError(f"{cell.name}: {e}") from None
    return cells


def file_sha256(path: str | None) -> str | None:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None


def sparse_recall(layers: list[dict[str, Any]]) -> float | None:
    """Mean attention recall over the layers that read less than the whole context (all layers if none did)."""
    scored = [x for x in layers if x["recall"] is not None]
    sparse = [x for x in scored if x["attended_fraction"] is not None and x["attended_fraction"] < 1 - 1e-9]
    use = sparse or scored
    return sum(x["recall"] for x in use) / len(use) if use else None


def pooled(cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Cells ``{"score", "n"}`` pooled into one score with its count and Wilson 95 % interval."""
    n = sum(c["n"] for c in cells)
    if not n:
        return None
    total = sum(c["score"] * c["n"] for c in cells)
    return {"score": total / n, "n": n, "interval": list(wilson_interval(total, n))}


def shown_path(path: str | None) -> str | None:
    """A manifest's path as a cell records it: relative to the working directory when inside it, so the files
    a run writes name no machine's folders (the same grid run anywhere gives the same bytes)."""
    if path is None or not Path(path).is_absolute():
        return path
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def row_of(cell: Cell, result: dict[str, Any], wall: float) -> dict[str, Any]:
    tasks = {task: pooled(list(by_length.values())) for task, by_length in result["tasks"].items()}
    return {"label": cell.label, "policy": cell.policy, "budget": cell.budget, "manifest": shown_path(cell.manifest),
            "params": cell.params, "prompts": len(result["samples"]), "passkey_accuracy": result["passkey_accuracy"],
            "score": pooled([c for by_length in result["tasks"].values() for c in by_length.values()]),
            "tasks": tasks, "task_lengths": result["tasks"],
            "recall_sparse_layers": sparse_recall(result["layers"]), "kl_mean": result["kl_mean"],
            "top1_agreement": result["top1_agreement"], "attended_fraction": result["attended_fraction"],
            "kv_bytes_per_prompt": result.get("kv_bytes_per_prompt"), "wall_s": wall, "passkey_grid": result["passkey_grid"],
            "seconds": result.get("seconds"),
            # per prompt, in the suite's order (the same prompts in every cell): for paired comparisons
            "scores": [None if r["score"] is None else round(r["score"], 4) for r in result["samples"]]}


def fidelity_row(cell: Cell, result: dict[str, Any], wall: float) -> dict[str, Any]:
    return {"label": cell.label, "policy": cell.policy, "budget": cell.budget, "manifest": shown_path(cell.manifest),
            "params": cell.params, "prompts": result["prompts"], "kl_mean": result["kl_mean"],
            "kl_interval": result["kl_interval"], "top1_agreement": result["top1_agreement"],
            "divergence_median": result["divergence_median"], "never_diverged": result["never_diverged"],
            "wall_s": wall}


def format_fidelity_table(summary: dict[str, Any]) -> str:
    r0 = summary["reasoning"]
    lines = [f"## Reasoning fidelity: {summary['model']}", "",
             f"Full attention's greedy traces on {r0['source']} ({r0['limit']} prompts, up to {r0['max_new_tokens']} "
             f"tokens), each policy fed the same tokens; {summary['device_name']}, {summary['dtype']}. KL(full ‖ "
             "policy) per step with its 95 % bootstrap interval over prompts; divergence point = the first generated "
             "token the policy would have chosen otherwise.", "",
             "| policy | budget | KL per step [95 %] | top-1 | median divergence | never diverged | wall (s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary["rows"]:
        ci = r["kl_interval"]
        kl = "–" if r["kl_mean"] is None else f"{r['kl_mean']:.2e}" + (f" [{ci[0]:.2e}, {ci[1]:.2e}]" if ci else "")
        lines.append(f"| {r['label']} | {r['budget'] or '–'} | {kl} | {f(r['top1_agreement'], '.4f')} | "
                     f"{r['divergence_median'] or 'none'} | {r['never_diverged']:.2f} | {r['wall_s']:.1f} |")
    return "\n".join(lines) + "\n"


def with_interval(cell: dict[str, Any] | None) -> str:
    return "–" if cell is None else f"{cell['score']:.3f} [{cell['interval'][0]:.3f}, {cell['interval'][1]:.3f}]"


def f(x: Any, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


def describe(s: dict[str, Any]) -> str:
    if s["prompts"]:
        return s["prompts"]
    lengths = ", ".join(map(str, s["lengths"]))
    if s["suite"] == "longbench":
        return (f"LongBench ({', '.join(s['tasks']) or 'all sixteen English tasks'}), the first "
                f"{s['samples_per_cell']} of each task cut to {lengths} tokens; each task's own generation budget "
                "and metric")
    if s["suite"] == "ruler":
        return (f"RULER-style suite ({', '.join(s['tasks']) or 'all eleven tasks'}) in {s['source']}, lengths "
                f"{lengths}, {s['samples_per_cell']} per task and length, seed {s['seed']}; each task's own "
                "generation budget")
    return (f"single {s['passkey_words']}-word passkey ({s['alphabet']}) in {s['source']}, lengths {lengths}, depths "
            f"{', '.join(map(str, s['depths']))}, {s['samples_per_cell']} per cell; {s['max_new_tokens']} greedy tokens")


def length_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each row's score per prompt length, every task pooled (full attention's row: the ceiling at each length);
    only for grids of more than one length."""
    lengths = sorted({int(n) for r in rows for by_length in r.get("task_lengths", {}).values() for n in by_length})
    if len(lengths) < 2:
        return []
    lines = ["", "Per length (score [95 %], all tasks pooled):", "",
             "| policy | budget | " + " | ".join(map(str, lengths)) + " |", "| --- | --- |" + " --- |" * len(lengths)]
    for r in rows:
        by = {n: pooled([cell for cells in r.get("task_lengths", {}).values() for key, cell in cells.items()
                         if int(key) == n]) for n in lengths}
        lines.append(f"| {r['label']} | {r['budget'] or '–'} | " + " | ".join(with_interval(by[n]) for n in lengths)
                     + " |")
    return lines


def device_names(rows: list[dict[str, Any]]) -> list[str | None]:
    """The devices a grid's cells ran on, each once, in the rows' order (None: a cell that recorded none; a
    cell resumed on another machine names each, joined by " and ")."""
    names: list[str | None] = []
    for r in rows:
        name = r.get("device_name")
        names += name.split(" and ") if name else [None]
    return list(dict.fromkeys(names))


def several_gpus(rows: list[dict[str, Any]]) -> bool:
    """Whether a grid's cells ran on more than one kind of device (a grid resumed on another machine)."""
    return len(device_names(rows)) > 1


def short_gpu(name: str | None) -> str:
    """``NVIDIA H100 80GB HBM3`` → ``H100``: the model of a device name, for a table cell."""
    if not name:
        return "?"
    found = re.search(r"\b([A-Z]+\d{2,4}[A-Z]*)\b", name.removeprefix("NVIDIA "))
    return found.group(1) if found else name


def short_gpus(name: str | None) -> str:
    """A cell's device names, each shortened: ``NVIDIA H100 80GB HBM3 and NVIDIA H200`` → ``H100 + H200``."""
    return " + ".join(short_gpu(part) for part in (name or "").split(" and "))


def wall_of(row: dict[str, Any]) -> float:
    """The seconds a cell took: summed over its batches where the engine recorded them, so a cell resumed over
    several runs counts every run (its ``wall_s`` is the last run's alone); else that run's wall clock."""
    seconds = row.get("seconds")
    return seconds["total"] if seconds else row["wall_s"]


def format_table(summary: dict[str, Any]) -> str:
    several = several_gpus(summary["rows"])
    lines = [f"## Quality grid: {summary['model']}", "",
             f"{describe(summary['settings'])}; {summary['device_name']}, {summary['dtype']}. Score: the share of "
             "expected strings generated (passkey: correct or not), with its Wilson 95 % interval. "
             "KL(full ‖ policy) and top-1 agreement per decode step against a dense forward pass over the same tokens; "
             "recall = attention mass inside what a layer read, mean over the layers that read less than the whole "
             "context (measured only with --measure or on the CPU); read = fraction of the keys read over all layers; "
             "KV = MB of KV cache a prompt held on the engine (its K/V slots over all layers; – where not recorded); "
             "wall = seconds for the cell (every run of a resumed cell)" + (", on the GPU named beside it."
                                                                           if several else "."),
             "", "| policy | budget | score [95 %] | n | recall | KL | top-1 | read | KV (MB) | wall (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary["rows"]:
        score = r.get("score")
        where = f" ({short_gpus(r.get('device_name'))})" if several else ""
        kv = r.get("kv_bytes_per_prompt")
        lines.append(f"| {r['label']} | {r['budget'] or '–'} | {with_interval(score)} | {score['n'] if score else '–'} "
                     f"| {f(r['recall_sparse_layers'])} | {f(r['kl_mean'], '.2e')} | {f(r['top1_agreement'])} | "
                     f"{f(r['attended_fraction'])} | {f(None if kv is None else kv / 1e6, '.1f')} | "
                     f"{wall_of(r):.1f}{where} |")
    lines += length_lines(summary["rows"])
    tasks = sorted({t for r in summary["rows"] for t in r.get("tasks", {})})
    if len(tasks) > 1:
        lines += ["", "Per task (score [95 %], all lengths pooled):", "",
                  "| policy | budget | " + " | ".join(tasks) + " |", "| --- | --- |" + " --- |" * len(tasks)]
        for r in summary["rows"]:
            lines.append(f"| {r['label']} | {r['budget'] or '–'} | "
                         + " | ".join(with_interval(r["tasks"].get(t)) for t in tasks) + " |")
    lines += paired_lines(summary["rows"]) + time_lines(summary["rows"])
    total = sum(wall_of(r) for r in summary["rows"])
    prompts = sum(r["prompts"] for r in summary["rows"])
    lines += ["", f"{len(summary['rows'])} cells, {prompts} prompts, {total:.0f} s of evaluation in all "
                  f"({prompts / max(total, 1e-9):.2f} prompts/s).", "", "Budget → parameters:", ""]
    for policy, text in MAPPING.items():
        if any(r["policy"] == policy for r in summary["rows"]):
            lines.append(f"- {policy}: {text}")
    manifests = sorted({(r["label"], r["manifest"]) for r in summary["rows"] if r["manifest"]})
    if manifests:
        lines += ["", "Manifests: " + "; ".join(f"{label} `{path}`" for label, path in manifests)]
    return "\n".join(lines) + "\n"


def time_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Where each cell's time went on the engine (``rolecall.eval.time_split``), for the cells that recorded it."""
    from rolecall.eval import TIME_PARTS

    timed = [r for r in rows if r.get("seconds")]
    if not timed:
        return []
    parts = [*TIME_PARTS[:-1], "other"]
    lines = ["", "Where the time went (seconds summed over a cell's batches; a shared prefill counts to the cell that "
             "ran it; setup = the decoder and its cache, other = attaching the policy, KL against the reference, "
             "bookkeeping):", "", "| policy | budget | batches | " + " | ".join(parts) + " | total |",
             "| --- | --- | --- |" + " --- |" * (len(parts) + 1)]
    for r in timed:
        t = r["seconds"]
        lines.append(f"| {r['label']} | {r['budget'] or '–'} | {t['batches']} | "
                     + " | ".join(f"{t[p]:.1f}" for p in parts) + f" | {t['total']:.1f} |")
    return lines


def paired_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each policy's score minus full's and minus Quest's at the same budget, over the very same prompts, with
    the 95 % interval of the mean paired difference; ``*`` marks an interval that excludes 0 (significant)."""
    refs = {"full": next((r for r in rows if r["policy"] == "full" and pairable_scores(r)), None)}
    out = []
    for r in rows:
        if r["policy"] == "full" or not pairable_scores(r):
            continue
        refs["quest"] = next((q for q in rows if q["policy"] == "quest" and q["budget"] == r["budget"] and pairable_scores(q)), None)
        cells = []
        for name in ("full", "quest"):
            ref = refs[name]
            if ref is None or ref is r or len(pairable_scores(ref)) != len(pairable_scores(r)):
                cells.append("–")
                continue
            d = paired_difference(pairable_scores(r), pairable_scores(ref))
            lo, hi = d["interval"]
            cells.append(f"{d['mean']:+.3f} [{lo:+.3f}, {hi:+.3f}]" + (" *" if lo > 0 or hi < 0 else ""))
        out.append(f"| {r['label']} | {r['budget'] or '–'} | {cells[0]} | {cells[1]} |")
    if not out:
        return []
    return ["", "Paired differences over the same prompts (mean score difference, 95 % interval; * = the interval "
            "excludes 0, a significant difference):", "", "| policy | budget | − full | − quest |",
            "| --- | --- | --- | --- |", *out]


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"alias, Hugging Face id or local folder (default {DEFAULT_MODEL})")
    parser.add_argument("--policies", nargs="+", default=None,
                        help=f"subset of {', '.join(POLICIES)} (default: every one whose manifest is given)")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS), help="token budgets")
    parser.add_argument("--delta", default=None, help="DELTA manifest (layers.role), e.g. from calibrate-delta")
    parser.add_argument("--measure", action="store_true", default=None,
                        help="also measure per-layer attention recall (the transformers path; on a GPU the policies "
                        "otherwise decode on the engine)")
    parser.add_argument("--delta-recall", default=None, help="a second DELTA manifest (calibrate-delta --select recall)")
    parser.add_argument("--heads", action="append", metavar="NAME=PATH",
                        help="LycheeDecode heads manifest, repeatable (e.g. hardkuma=..., hardconcrete=..., sigmoid=...)")
    parser.add_argument("--lethe", default=None, help="manifest with layers.budget (default: the same budget every layer)")
    parser.add_argument("--vattention-epsilon", type=float, default=0.05, help="vAttention's ε (default 0.05)")
    parser.add_argument("--vattention-delta", type=float, default=0.05, help="vAttention's δ (default 0.05)")
    add_prompt_arguments(parser, passkey_words=5, alphabet="digits", limit=16)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow code shipped in the model folder to run (never without this flag)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--combined", action="store_true",
                        help="also the combined DELTA + vAttention policy (vattention on each DELTA manifest: heavy "
                        "hitters from the nearest Δ-layer's scores), rows vattention-delta[-recall]")
    parser.add_argument("--variant", action="append", metavar="POLICY:KEY=VALUE[,KEY=VALUE]",
                        help="extra rows: every row of POLICY again with these parameters, its label suffixed by "
                        "them (e.g. delta:per_head=true → delta-per_head); repeatable")
    parser.add_argument("--out", required=True, help="output folder; rerunning into it resumes")
    parser.add_argument("--summarize", action="store_true",
                        help="run nothing: rewrite the summary, tables and plots from the cells done in --out (cells "
                             "of this command not done there are left out and counted); no model loads")


def new_tokens(args: argparse.Namespace) -> int:
    """The most tokens a prompt generates (RULER tasks carry their own budget; unknown tasks: ``ValueError``)."""
    from rolecall.eval import suite_new_tokens

    return args.max_new_tokens if args.suite == "reasoning" else suite_new_tokens(eval_settings(args))


def check_source(args: argparse.Namespace) -> None:
    """The prompts' source read before anything loads, as building the prompts will read it: the haystack corpus
    (``--source``), LongBench's copy (``--data``) or the reasoning prompts (``--reasoning-source``); a prompt file
    is checked with the prompt flags. Missing or unusable: ``ValueError`` in one line naming the flag."""
    if args.suite == "reasoning":
        from rolecall.data.reasoning import load_problems

        flag, read = "--reasoning-source", lambda: load_problems(args.reasoning_source, args.limit)
    elif args.prompts:
        return
    elif args.suite == "longbench":
        from rolecall.data.longbench import TASKS, load_tasks

        flag, read = "--data", lambda: load_tasks(args.tasks or tuple(TASKS), args.data, limit=args.samples_per_cell)
    else:
        from rolecall.data.corpora import load_corpus

        flag, read = "--source", lambda: load_corpus(args.source).fingerprint()
    try:
        read()
    except (ValueError, OSError) as e:
        raise ValueError(str(e) if str(e).startswith(flag) else f"{flag}: {e}") from None


def resumed(cells: list[Cell], out: Path, common: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings each cell's file must hold, and the cells already done in ``out`` (:func:`kept_cells`),
    refusing cells made with other settings before anything loads."""
    grids, done = {}, {}
    kept, where = kept_cells(out)
    for cell in cells:
        grid = {**common, "policy": cell.policy, "params": cell.params, "manifest_sha256": file_sha256(cell.manifest)}
        grids[cell.name] = json.loads(json.dumps(grid))  # as it reads back from a file (tuples become lists)
        if cell.name in kept:
            done[cell.name] = kept[cell.name]
            if _comparable(done[cell.name]["grid"]) != _comparable(grids[cell.name]):
                shown = where / f"{cell.name}.json" if where.is_dir() else f"{where} (cell {cell.name})"
                raise ValueError(f"{shown} was made with other settings (model, device, prompts, parameters or "
                                 "manifest); use another --out or delete the cell")
    return grids, done


def kept_cells(out: Path) -> tuple[dict[str, dict[str, Any]], Path]:
    """The cells done in ``out`` by name and where they were read: its ``cells/`` files, or where it has none, its
    :data:`ARCHIVE` (a grid kept as that one file)."""
    files = sorted((out / "cells").glob("*.json"))
    if files or not (out / ARCHIVE).exists():
        return {p.stem: json.loads(p.read_text()) for p in files}, out / "cells"
    return read_archive(out), out / ARCHIVE


def read_archive(out: Path) -> dict[str, dict[str, Any]]:
    """The cells packed in ``out/cells.jsonl.xz`` by name: one JSON line per cell, its file's record with its
    name added."""
    with lzma.open(out / ARCHIVE, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r.pop("name"): r for r in records}


def write_cell(out: Path, name: str, record: dict[str, Any]) -> None:
    atomic.write_text(out / "cells" / f"{name}.json", json.dumps(record, indent=1, default=str))


def pack(out: Path) -> bool:
    """Packs every cell file of ``out/cells/`` into ``out/cells.jsonl.xz``, sorted by name (the same cells give
    the same bytes); False when the archive already holds exactly them. The files stay: they are the working copy
    (git ignores them in ``artifacts/``, where the archive is the record)."""
    cells = {p.stem: json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))}
    if (out / ARCHIVE).exists() and json.loads(json.dumps(read_archive(out))) == json.loads(json.dumps(cells)):
        return False
    text = "".join(json.dumps({"name": name, **cells[name]}, default=str) + "\n" for name in sorted(cells))
    atomic.write_bytes(out / ARCHIVE, lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME))
    return True


def _comparable(grid: dict[str, Any]) -> dict[str, Any]:
    """A cell's settings without the ones left unset (None): a setting added since a cell was written, at its
    default, does not make the cell another one."""
    settings = grid.get("settings")
    if not isinstance(settings, dict):
        return grid
    return {**grid, "settings": {k: v for k, v in settings.items() if v is not None}}


def partial_file(out: Path, cell: Cell) -> Path:
    """Where a cell's finished batches are kept until the cell is written, so a lost machine costs one batch
    (not on the measuring path)."""
    return out / "cells" / f"{cell.name}.partial.jsonl"


def run_cell(cell: Cell, model, tokenizer, settings: EvalSettings | None, samples, args) -> tuple[dict, dict]:
    """One cell's full result and its table row."""
    from rolecall.eval import fidelity

    start = time.perf_counter()
    if settings is None:  # --suite reasoning
        result = fidelity(model, tokenizer, cell.manifest, cell.policy, cell.params, source=args.reasoning_source,
                          limit=args.limit, max_new_tokens=args.max_new_tokens)
        return result, fidelity_row(cell, result, time.perf_counter() - start)
    result = evaluate(model, tokenizer, cell.manifest, cell.policy, cell.params, settings, samples=samples,
                      measure=args.measure, batch_size=args.batch_size, checkpoint=partial_file(Path(args.out), cell),
                      allow_long_context=args.allow_long_context)
    return result, row_of(cell, result, time.perf_counter() - start)


def check_cells(cells: list[Cell], args: argparse.Namespace):
    """Each cell's manifest against the model's config (read without its weights) and against its policy, before
    any cell runs: a grid stops here in one line (``ValueError``), not when it reaches that cell. Returns the
    config."""
    from rolecall.core.manifest import RoleManifest
    from rolecall.core.models import load_config

    config = load_config(args.model, trust_remote_code=args.trust_remote_code)
    manifests = {path: RoleManifest.load(path) for path in {c.manifest for c in cells if c.manifest}}
    for cell in cells:
        try:
            check_policy(cell.policy, cell.params, manifests.get(cell.manifest), config)
        except ValueError as e:
            raise ValueError(f"{cell.name}: {e}") from None
    return config


def run_together(cells: list[Cell], model, tokenizer, settings: EvalSettings, samples, args) -> dict[str, tuple]:
    """The cells' results and rows from one :func:`rolecall.eval.evaluate_many` call: on the engine each batch is
    prefilled once for all of them. Each cell keeps its own checkpoint file, so a stop resumes every one."""
    from rolecall.eval import Job, evaluate_many

    jobs = [Job(c.policy, c.manifest, c.params, partial_file(Path(args.out), c)) for c in cells]
    results = evaluate_many(model, tokenizer, jobs, settings, samples, measure=args.measure, batch_size=args.batch_size,
                            allow_long_context=args.allow_long_context)
    return {c.name: (r, row_of(c, r, j.seconds)) for c, j, r in zip(cells, jobs, results)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, with every value that the flags alone decide refused in one line before anything is read or
    loaded: the prompts' settings, the cells and their manifest files, the dtype. Sets ``cells``, ``settings``
    (None for ``--suite reasoning``) and ``command`` (the line ``COMMAND.txt`` records)."""
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    parser.check_writable(args.out, "--out", folder=True)  # the cells are written into it as they finish
    try:
        check_prompt_arguments(args)
    except ValueError as e:
        parser.error(str(e))
    at_least(parser, args, budgets=1, lengths=1, limit=1,
             max_new_tokens=(2, "the first token comes from the dense prefill"))
    if not all(0 <= d <= 1 for d in args.depths):
        parser.error(f"--depths takes places in the context from 0 (its start) to 1 (its end), got "
                     f"{' '.join(map(str, args.depths))}")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        parser.error(f"--dtype {args.dtype!r} is not a torch dtype; use float32, bfloat16 or float16")
    try:
        args.settings = None if args.suite == "reasoning" else eval_settings(args)
        new_tokens(args)
        args.cells = build_cells(args)
    except ValueError as e:
        parser.error(str(e))
    missing = next((c for c in args.cells if c.manifest and not Path(c.manifest).is_file()), None)
    if missing is not None:
        parser.error(f"{missing.name}: no manifest file at {missing.manifest}; give the path that calibrate-delta or "
                     "train-heads wrote")
    args.command = shlex.join(["python", "-m", "benchmarks.quality", *argv])
    return args


def prepare(args: argparse.Namespace, todo: list, reasoning: bool, settings: Any) -> tuple[Any, Any]:
    """The tokenizer and the prompts the cells still to run need, after every check (a device this machine
    lacks, the haystack source, the cells' settings, lengths past the model's context: one line each, before
    anything is written or the weights load)."""
    from rolecall.core.models import context_limit, load_tokenizer

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device here, and {len(todo)} cells are not done; use --device cpu")
    check_source(args)
    limit, new = context_limit(check_cells(todo, args)), new_tokens(args)
    if limit and not (args.prompts or reasoning) and max(args.lengths) + new > limit:
        too_long = f"--lengths: {max(args.lengths)} + {new} new tokens exceeds the model's {limit} positions"
        if not args.allow_long_context:
            raise ValueError(f"{too_long}; use shorter lengths, or --allow-long-context with --rope-theta")
        print(f"warning: {too_long} (--allow-long-context)", file=sys.stderr)
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    # a length too short for a task's question, a corpus too small: one line, no cell run
    samples = None if reasoning else suite_prompts(tokenizer, settings)
    return tokenizer, samples


def open_grid(out: Path, command: str, running: bool) -> None:
    """The grid's folder ready for cells: a packed grid's cells unpacked when some are to run (the working copy
    first), and ``command`` added to ``COMMAND.txt`` unless it is its last line (resumed, re-summarised: once)."""
    (out / "cells").mkdir(parents=True, exist_ok=True)
    if running and not list((out / "cells").glob("*.json")) and (out / ARCHIVE).exists():
        for name, record in read_archive(out).items():
            write_cell(out, name, record)
    previous = (out / "COMMAND.txt").read_text() if (out / "COMMAND.txt").exists() else ""
    if previous.rstrip("\n").rpartition("\n")[2] != command:
        atomic.write_text(out / "COMMAND.txt", previous + command + "\n")


def write_summary(args: argparse.Namespace, out: Path, common: dict, rows: list, cells: int, done: int,
                  resumed_count: int, here: str) -> None:
    """``summary.json``, ``TABLE.md`` and the plots from the rows of the ``done`` of ``cells`` cells (a finished
    grid's cells packed into its archive), and what ran printed."""
    reasoning = args.suite == "reasoning"
    packed = done == cells and not args.summarize and pack(out)  # a finished grid
    names = [name for name in device_names(rows) if name]  # where the cells ran
    device_name = " and ".join(names) if names else here
    summary = {**common, "device_name": device_name, "budgets": args.budgets, "mapping": MAPPING, "rows": rows}
    atomic.write_text(out / "summary.json", json.dumps(summary, separators=(",", ":"), default=str) + "\n")  # compact: TABLE.md is the one to read
    table = format_fidelity_table(summary) if reasoning else format_table(summary)
    atomic.write_text(out / "TABLE.md", table)
    plots = plot_fidelity(summary, out) if reasoning else plot(summary, out)
    print(table)
    ran = f"{cells - done} cells not done, left out" if args.summarize else f"{done - resumed_count} cells run"
    print(f"{ran}, {resumed_count} resumed from {out}; "
          f"wrote summary.json, TABLE.md, {', '.join(plots + [ARCHIVE] * packed)}")


def run(args: argparse.Namespace) -> int:
    reasoning, settings, cells, dtype = args.suite == "reasoning", args.settings, args.cells, args.dtype
    out = Path(args.out)
    common = {"model": args.model, "device": args.device, "dtype": dtype}
    if args.rope_theta is not None:  # another model, in effect: cells made without it are not these
        common["rope_theta"] = args.rope_theta
    if reasoning:
        common["reasoning"] = {"source": args.reasoning_source, "limit": args.limit, "max_new_tokens": args.max_new_tokens}
    else:
        common["settings"] = asdict(settings)
    grids, done = resumed(cells, out, common)
    resumed_count = len(done)
    if args.summarize and not done:
        raise ValueError(f"--summarize: none of this command's {len(cells)} cells is done in {out / 'cells'}; "
                         "run it without --summarize first")
    tokenizer = samples = None
    todo = [] if args.summarize else [c for c in cells if c.name not in done]  # a finished grid: the summary only
    if todo:  # what the cells need, checked and built before anything is written or the weights load
        tokenizer, samples = prepare(args, todo, reasoning, settings)
    open_grid(out, args.command, bool(todo))

    from tqdm import tqdm

    from rolecall.core.models import load_model

    model = None
    if todo:
        model = load_model(args.model, dtype=dtype, trust_remote_code=args.trust_remote_code,
                           rope_theta=args.rope_theta).to(args.device)
    here = (torch.cuda.get_device_name() if torch.cuda.is_available() else "CUDA") if args.device == "cuda" else "CPU"

    rows, shared = [], {}
    if not (args.summarize or reasoning or args.measure) and args.device == "cuda" and len(todo) > 1:
        print(f"{len(todo)} cells decode together: each batch is prefilled once for all of them", file=sys.stderr)
        shared = run_together(todo, model, tokenizer, settings, samples, args)
    # On a terminal one bar over the cells, the prompts' bars below it; in a log (no terminal) a line per cell
    # instead, since a bar below another moves the cursor up with escape codes a log keeps as text.
    terminal = sys.stderr.isatty()
    bar = tqdm(cells, desc="quality grid", unit="cell", disable=not terminal)
    for number, cell in enumerate(bar, 1):
        if cell.name in done:
            rows.append(done[cell.name]["row"])
            continue
        if args.summarize:
            continue
        bar.set_postfix_str(cell.name)
        result, row = shared.pop(cell.name) if cell.name in shared else run_cell(cell, model, tokenizer, settings,
                                                                                  samples, args)
        row["device_name"] = " and ".join(result.get("devices") or [here])  # every GPU a resumed cell ran on
        done[cell.name] = {"grid": grids[cell.name], "cell": asdict(cell), "row": row, "result": result}
        write_cell(out, cell.name, done[cell.name])
        partial_file(out, cell).unlink(missing_ok=True)
        rows.append(row)
        if not terminal:
            print(f"quality grid: cell {number}/{len(cells)} {cell.name} done", file=sys.stderr, flush=True)
    bar.close()
    write_summary(args, out, common, rows, len(cells), len(done), resumed_count, here)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Refusals in one line, exit status 2: bad flags from the parser, the rest (a grid made with other settings,
    a missing corpus, an out-of-memory GPU) from the run."""
    return run_reporting_errors(PROG, run, parse_args(sys.argv[1:] if argv is None else list(argv)))


if __name__ == "__main__":
    sys.exit(main())
