"""A quality grid's summary as Markdown: the main table (score with its Wilson interval, recall, KL, top-1, keys
read, KV held, wall time), per length, per task, paired differences to full attention and Quest, where the time went;
the reasoning suite's fidelity table. Each takes the ``summary.json`` object :func:`rolecall.eval.grid.write_summary`
writes."""

from __future__ import annotations

import re
from typing import Any

from rolecall.eval.budgets import MAPPING
from rolecall.eval.stats import paired_difference, pooled


def pairable_scores(row: dict[str, Any] | None) -> list[float] | None:
    """A grid row's per-prompt scores when every prompt has one (what a paired comparison needs), else None."""
    scores = (row or {}).get("scores")
    return scores if scores and None not in scores else None


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
