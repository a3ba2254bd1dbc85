"""Passkey quality of every decode policy at a grid of token budgets, for one model: a table, a plot, JSON.

    python benchmarks/quality.py --model smollm2-135m --alphabet digits --passkey-words 5 \\
        --delta artifacts/smollm2-135m/smollm2-135m.delta.safetensors \\
        --heads hardkuma=artifacts/smollm2-135m/heads.safetensors \\
        --lethe artifacts/smollm2-135m/smollm2-135m.delta.safetensors --out results/quality-smollm2

Every (policy, budget) cell runs ``runtime.eval.evaluate`` on the same passkey prompts (lengths × depths ×
samples, built once) and gets one JSON file in ``--out/cells/``, written atomically as soon as the cell is
done. A second run with the same settings skips the cells whose file exists, so a killed run continues
where it stopped; a cell made with other settings is refused rather than mixed in. At the end it writes
``summary.json``, ``TABLE.md`` (also printed), ``quality.png`` (accuracy and KL against the budget, one line
per policy) and appends the command line to ``COMMAND.txt``.

A budget is a token count; how it becomes each policy's own parameters is ``MAPPING`` (written into the
table). ``full`` does not depend on it and runs once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import atomic  # noqa: E402
from runtime.eval import EvalSettings, evaluate, load_prompts, passkey_prompts  # noqa: E402
from runtime.models import DEFAULT_MODEL  # noqa: E402
from runtime.policies import get_policy  # noqa: E402

POLICIES = ("full", "delta", "lychee", "lethe", "vattention", "quest")
BUDGETS = (256, 512, 1024, 2048)
PAGE = 16  # DELTA's and Quest's page size P

MAPPING = {
    "delta": "K = ceil(budget / 16) pages of 16 tokens, the L = max(1, K / 8) most recent among them (the paper's "
             "L/K = 8/64); full and Δ-layers read everything",
    "lychee": "budget tokens (block size 1, the current token included) for each sparse head; retrieval heads "
              "read everything",
    "lethe": "budget = mean slots per layer, shared out over layers in proportion to the manifest's layers.budget "
             "(uniform without --lethe); memory stops growing there",
    "vattention": "deterministic set of 4 sinks + window budget/4 + heavy hitters budget/2 per KV head, then the "
                  "CLT sample that ε, δ need on top (not capped: its reads are the 'read' column)",
    "quest": "K = ceil(budget / 16) pages per KV head by the min/max key bound, the current page included; layers "
             "0 and 1 dense",
}


def policy_params(policy: str, budget: int, args: argparse.Namespace) -> dict[str, Any]:
    """A token budget in ``policy``'s own parameters (see ``MAPPING``)."""
    if policy == "delta":
        pages = math.ceil(budget / PAGE)
        return {"budget": budget, "page_size": PAGE, "recent_pages": max(1, pages // 8)}
    if policy in ("lychee", "lethe"):
        return {"budget": budget}
    if policy == "vattention":
        return {"epsilon": args.vattention_epsilon, "delta": args.vattention_delta, "sinks": 4, "window": budget // 4,
                "heavy": budget // 2}
    if policy == "quest":
        return {"budget": budget, "page_size": PAGE}
    return {}


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
            raise SystemExit(f"--heads {pair!r}: write it as NAME=PATH with NAME made of letters, digits, '_', '-', "
                             "e.g. --heads hardkuma=artifacts/m/heads.safetensors")
        heads.append((name, path))
    return heads


def build_cells(args: argparse.Namespace) -> list[Cell]:
    """The grid, in table order; a policy asked for by name without the manifest it needs is an error."""
    heads = parse_heads(args.heads)
    have = {"full": True, "delta": bool(args.delta or args.delta_recall), "lychee": bool(heads), "lethe": True,
            "vattention": True, "quest": True}
    wanted = args.policies or [p for p in POLICIES if have[p]]
    for p in wanted:
        if p not in POLICIES:
            raise SystemExit(f"--policies: unknown policy {p!r}; choose from {', '.join(POLICIES)}")
        if not have[p]:
            flag = {"delta": "--delta (or --delta-recall)", "lychee": "--heads NAME=PATH"}[p]
            raise SystemExit(f"policy {p} needs {flag}; give the manifest or leave {p} out of --policies")
    rows: list[tuple[str, str, str | None]] = []
    for p in POLICIES:
        if p not in wanted:
            continue
        if p == "delta":
            rows += [(label, p, path) for label, path in (("delta", args.delta), ("delta-recall", args.delta_recall))
                     if path]
        elif p == "lychee":
            rows += [(f"lychee-{name}", p, path) for name, path in heads]
        else:
            rows.append((p, p, args.lethe if p == "lethe" else None))
    cells = []
    for label, policy, manifest in rows:
        if policy == "full":
            cells.append(Cell(label, policy, manifest, None))
            continue
        cells += [Cell(label, policy, manifest, b, policy_params(policy, b, args)) for b in args.budgets]
    for cell in cells:
        get_policy(cell.policy, **cell.params)  # bad values fail here, before the model loads
    return cells


def file_sha256(path: str | None) -> str | None:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None


def sparse_recall(layers: list[dict[str, Any]]) -> float | None:
    """Mean attention recall over the layers that read less than the whole context (all layers if none did)."""
    scored = [x for x in layers if x["recall"] is not None]
    sparse = [x for x in scored if x["attended_fraction"] is not None and x["attended_fraction"] < 1 - 1e-9]
    use = sparse or scored
    return sum(x["recall"] for x in use) / len(use) if use else None


def row_of(cell: Cell, result: dict[str, Any], wall: float) -> dict[str, Any]:
    return {"label": cell.label, "policy": cell.policy, "budget": cell.budget, "manifest": cell.manifest,
            "params": cell.params, "prompts": len(result["samples"]), "passkey_accuracy": result["passkey_accuracy"],
            "recall_sparse_layers": sparse_recall(result["layers"]), "kl_mean": result["kl_mean"],
            "top1_agreement": result["top1_agreement"], "attended_fraction": result["attended_fraction"],
            "wall_s": wall, "passkey_grid": result["passkey_grid"]}


def f(x: Any, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


def format_table(summary: dict[str, Any]) -> str:
    s = summary["settings"]
    source = s["prompts"] or (f"single {s['passkey_words']}-word passkey ({s['alphabet']}) in {s['source']}, lengths "
                              f"{', '.join(map(str, s['lengths']))}, depths {', '.join(map(str, s['depths']))}, "
                              f"{s['samples_per_cell']} per cell")
    lines = [f"## Quality grid: {summary['model']}", "",
             f"{source}; {s['max_new_tokens']} greedy tokens; {summary['device_name']}, {summary['dtype']}. "
             "KL(full ‖ policy) and top-1 agreement per decode step against a dense forward pass over the same tokens; "
             "recall = attention mass inside what a layer read, mean over the layers that read less than the whole "
             "context; read = fraction of the keys read over all layers; wall = seconds for the cell.", "",
             "| policy | budget | passkey | recall | KL | top-1 | read | wall (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary["rows"]:
        acc = "–" if r["passkey_accuracy"] is None else f"{r['passkey_accuracy']:.3f}"
        lines.append(f"| {r['label']} | {r['budget'] or '–'} | {acc} | {f(r['recall_sparse_layers'])} | "
                     f"{f(r['kl_mean'], '.2e')} | {f(r['top1_agreement'])} | {f(r['attended_fraction'])} | "
                     f"{r['wall_s']:.1f} |")
    total = sum(r["wall_s"] for r in summary["rows"])
    lines += ["", f"{len(summary['rows'])} cells, {total:.0f} s of evaluation in all.", "", "Budget → parameters:", ""]
    labels = {r["label"]: r for r in summary["rows"]}
    for policy, text in MAPPING.items():
        if any(r["policy"] == policy for r in labels.values()):
            lines.append(f"- {policy}: {text}")
    manifests = sorted({(r["label"], r["manifest"]) for r in summary["rows"] if r["manifest"]})
    if manifests:
        lines += ["", "Manifests: " + "; ".join(f"{label} `{path}`" for label, path in manifests)]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, kl_ax) = plt.subplots(1, 2, figsize=(11, 4))
    by_label: dict[str, list[dict[str, Any]]] = {}
    for r in summary["rows"]:
        by_label.setdefault(r["label"], []).append(r)
    for label, rows in by_label.items():
        if rows[0]["budget"] is None:  # full: reference lines (its KL is the numerical floor of the dtype)
            if rows[0]["passkey_accuracy"] is not None:
                acc_ax.axhline(rows[0]["passkey_accuracy"], color="black", ls="--", lw=1, label=label)
            if rows[0]["kl_mean"]:
                kl_ax.axhline(rows[0]["kl_mean"], color="black", ls="--", lw=1, label=label)
            continue
        rows = sorted(rows, key=lambda r: r["budget"])
        x = [r["budget"] for r in rows]
        acc_ax.plot(x, [math.nan if r["passkey_accuracy"] is None else r["passkey_accuracy"] for r in rows],
                    marker="o", label=label)
        kl_ax.plot(x, [math.nan if not r["kl_mean"] else r["kl_mean"] for r in rows], marker="o", label=label)
    for ax in (acc_ax, kl_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(summary["budgets"], [str(b) for b in summary["budgets"]])
        ax.minorticks_off()
        ax.set_xlabel("budget (tokens)")
        ax.grid(alpha=0.3)
    acc_ax.set_ylabel("passkey accuracy")
    acc_ax.set_ylim(-0.05, 1.05)
    kl_ax.set_yscale("log")
    kl_ax.set_ylabel("KL(full ‖ policy) per step")
    acc_ax.legend(fontsize=8, frameon=False)
    fig.suptitle(f"{summary['model']}: quality against the token budget", fontsize=10)
    fig.tight_layout()
    with atomic.atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


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
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000], help="passkey prompt lengths")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="passkey depths in [0, 1]")
    parser.add_argument("--samples-per-cell", type=int, default=1, help="prompts per (length, depth)")
    parser.add_argument("--passkey-words", type=int, default=5)
    parser.add_argument("--alphabet", default="digits", choices=("nato", "digits"),
                        help="digits for small models (they copy digits, not NATO words)")
    parser.add_argument("--source", default="pg-essays", help="haystack text (see data.corpora)")
    parser.add_argument("--prompts", default=None, help='JSONL of {"prompt", "answer"} instead of passkey prompts')
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--out", required=True, help="output folder; rerunning into it resumes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise SystemExit(f"--dtype {dtype!r} is not a torch dtype; use float32, bfloat16 or float16")
    settings = EvalSettings(lengths=tuple(args.lengths), depths=tuple(args.depths), samples_per_cell=args.samples_per_cell,
                            passkey_words=args.passkey_words, alphabet=args.alphabet, source=args.source,
                            prompts=args.prompts, max_new_tokens=args.max_new_tokens)
    cells = build_cells(args)
    out = Path(args.out)
    common = {"model": args.model, "device": args.device, "dtype": dtype, "settings": asdict(settings)}
    grids, done = {}, {}
    for cell in cells:  # cells already in --out must come from these settings: checked before the model loads
        grid = {**common, "policy": cell.policy, "params": cell.params, "manifest_sha256": file_sha256(cell.manifest)}
        grids[cell.name] = json.loads(json.dumps(grid))  # as it reads back from a file (tuples become lists)
        path = out / "cells" / f"{cell.name}.json"
        if path.exists():
            done[cell.name] = json.loads(path.read_text())
            if done[cell.name]["grid"] != grids[cell.name]:
                raise SystemExit(f"{path} was made with other settings (model, device, prompts, parameters or "
                                 "manifest); use another --out or delete the file")
    (out / "cells").mkdir(parents=True, exist_ok=True)
    previous = (out / "COMMAND.txt").read_text() if (out / "COMMAND.txt").exists() else ""
    atomic.write_text(out / "COMMAND.txt", previous + shlex.join(["python", "benchmarks/quality.py", *argv]) + "\n")

    from tqdm import tqdm

    from runtime.models import load_model, load_tokenizer

    if len(done) < len(cells):  # a finished grid only rewrites the summary, table and plot
        model = load_model(args.model, dtype=dtype).to(args.device)
        tokenizer = load_tokenizer(args.model)
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit and not args.prompts and max(args.lengths) + args.max_new_tokens > limit:
            raise SystemExit(f"--lengths: {max(args.lengths)} + {args.max_new_tokens} new tokens exceeds the model's "
                             f"{limit} positions; use shorter lengths")
        samples = load_prompts(args.prompts, tokenizer) if args.prompts else passkey_prompts(tokenizer, settings)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"

    rows = []
    bar = tqdm(cells, desc="quality grid", unit="cell")
    for cell in bar:
        if cell.name in done:
            rows.append(done[cell.name]["row"])
            continue
        bar.set_postfix_str(cell.name)
        start = time.perf_counter()
        result = evaluate(model, tokenizer, cell.manifest, cell.policy, cell.params, settings, samples=samples,
                          measure=args.measure)
        row = row_of(cell, result, time.perf_counter() - start)
        atomic.write_text(out / "cells" / f"{cell.name}.json", json.dumps(
            {"grid": grids[cell.name], "cell": asdict(cell), "row": row, "result": result}, indent=1, default=str))
        rows.append(row)
    summary = {**common, "device_name": device_name, "budgets": args.budgets, "mapping": MAPPING, "rows": rows}
    atomic.write_text(out / "summary.json", json.dumps(summary, indent=1, default=str))
    table = format_table(summary)
    atomic.write_text(out / "TABLE.md", table)
    plot(summary, out / "quality.png")
    print(table)
    print(f"{len(cells) - len(done)} cells run, {len(done)} resumed from {out / 'cells'}; "
          f"wrote summary.json, TABLE.md, quality.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
