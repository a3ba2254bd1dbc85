"""A quality grid: every decode policy at a set of token budgets, each (policy, budget) cell evaluated on the same
prompts, for one model.

Every cell runs :func:`rolecall.eval.evaluate` on the same prompts (the passkey grid, lengths × depths × samples;
the RULER-style or LongBench suite, tasks × lengths × samples; built once), or with the reasoning suite
:func:`rolecall.eval.fidelity` (full attention's own greedy trace, each policy fed the same tokens), and gets one
JSON file in ``out/cells/``, written atomically as soon as the cell is done. On a GPU the cells still to run go
through the batches together (:func:`rolecall.eval.evaluate_many`): each batch is prefilled once for all of them;
their files are written when all are done, and each keeps its finished batches in ``cells/<cell>.partial.jsonl``
meanwhile. A second run with the same settings skips the cells whose file exists, so a killed run continues where it
stopped; a cell made with other settings is refused rather than mixed in. Once every cell is done they are packed,
sorted by name, into :data:`ARCHIVE` (xz, one JSON line per cell); a folder with that file and no ``cells/`` (a grid
kept as its record) is summarised from it, and unpacked into ``cells/`` before a new cell runs. The summary is
``summary.json``, ``TABLE.md`` (:mod:`rolecall.eval.grid_tables`) and the plots (:mod:`rolecall.eval.grid_plots`).

A budget is a token count; how it becomes each policy's own parameters is
:data:`rolecall.eval.budgets.MAPPING`. ``full`` does not depend on it and runs once. ``rolecall grid`` (and
``benchmarks/quality.py``) reads its flags into a :class:`Grid` and runs it with these functions.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rolecall.core import atomic
from rolecall.eval.budgets import MAPPING
from rolecall.eval.grid_plots import plot, plot_fidelity
from rolecall.eval.grid_tables import device_names, format_fidelity_table, format_table
from rolecall.eval.runner import EvalSettings, evaluate
from rolecall.eval.stats import pooled

ARCHIVE = "cells.jsonl.xz"  # a finished grid's cells in one file, the record ``artifacts/`` keeps
POLICIES = ("full", "delta", "lychee", "lethe", "vattention", "quest")  # in table order
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


@dataclass
class Grid:
    """One grid: its cells, where they are kept (``out``), the prompts (``settings``; None for the reasoning suite,
    whose ``reasoning`` holds its ``source``, ``limit`` and ``max_new_tokens``), the model and how it loads, and how
    the cells decode (``measure``: the transformers path with per-layer recall; ``batch_size``: prompts a batch on the
    engine)."""

    model: str
    out: Path
    cells: list[Cell]
    budgets: list[int]
    settings: EvalSettings | None = None
    reasoning: dict[str, Any] | None = None
    device: str = "cpu"
    dtype: str = "float32"
    rope_theta: float | None = None
    trust_remote_code: bool = False
    measure: bool | None = None
    batch_size: int | None = None
    allow_long_context: bool = False

    def common(self) -> dict[str, Any]:
        """What every cell's file records of the run (beside its policy, parameters and manifest hash): a cell made
        with other values is not one of this grid's."""
        common = {"model": self.model, "device": self.device, "dtype": self.dtype}
        if self.rope_theta is not None:  # another model, in effect: cells made without it are not these
            common["rope_theta"] = self.rope_theta
        if self.settings is None:
            common["reasoning"] = self.reasoning
        else:
            common["settings"] = asdict(self.settings)
        return common


def file_sha256(path: str | None) -> str | None:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None


def sparse_recall(layers: list[dict[str, Any]]) -> float | None:
    """Mean attention recall over the layers that read less than the whole context (all layers if none did)."""
    scored = [x for x in layers if x["recall"] is not None]
    sparse = [x for x in scored if x["attended_fraction"] is not None and x["attended_fraction"] < 1 - 1e-9]
    use = sparse or scored
    return sum(x["recall"] for x in use) / len(use) if use else None


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
    """A cell's table row from its :func:`rolecall.eval.evaluate` result; ``wall``: the seconds it took."""
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
    """A cell's table row from its :func:`rolecall.eval.fidelity` result (the reasoning suite)."""
    return {"label": cell.label, "policy": cell.policy, "budget": cell.budget, "manifest": shown_path(cell.manifest),
            "params": cell.params, "prompts": result["prompts"], "kl_mean": result["kl_mean"],
            "kl_interval": result["kl_interval"], "top1_agreement": result["top1_agreement"],
            "divergence_median": result["divergence_median"], "never_diverged": result["never_diverged"],
            "wall_s": wall}


def resumed(grid: Grid) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings each cell's file must hold, and the cells already done in ``grid.out`` (:func:`kept_cells`),
    refusing cells made with other settings (``ValueError``, one line) before anything loads."""
    grids, done = {}, {}
    kept, where = kept_cells(grid.out)
    common = grid.common()
    for cell in grid.cells:
        settings = {**common, "policy": cell.policy, "params": cell.params, "manifest_sha256": file_sha256(cell.manifest)}
        grids[cell.name] = json.loads(json.dumps(settings))  # as it reads back from a file (tuples become lists)
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


def run_cell(grid: Grid, cell: Cell, model, tokenizer, samples) -> tuple[dict, dict]:
    """One cell's full result and its table row."""
    from rolecall.eval import fidelity

    start = time.perf_counter()
    if grid.settings is None:  # the reasoning suite
        result = fidelity(model, tokenizer, cell.manifest, cell.policy, cell.params, **grid.reasoning)
        return result, fidelity_row(cell, result, time.perf_counter() - start)
    result = evaluate(model, tokenizer, cell.manifest, cell.policy, cell.params, grid.settings, samples=samples,
                      measure=grid.measure, batch_size=grid.batch_size, checkpoint=partial_file(grid.out, cell),
                      allow_long_context=grid.allow_long_context)
    return result, row_of(cell, result, time.perf_counter() - start)


def run_together(grid: Grid, cells: list[Cell], model, tokenizer, samples) -> dict[str, tuple]:
    """The cells' results and rows from one :func:`rolecall.eval.evaluate_many` call: on the engine each batch is
    prefilled once for all of them. Each cell keeps its own checkpoint file, so a stop resumes every one."""
    from rolecall.eval import Job, evaluate_many

    jobs = [Job(c.policy, c.manifest, c.params, partial_file(grid.out, c)) for c in cells]
    results = evaluate_many(model, tokenizer, jobs, grid.settings, samples, measure=grid.measure,
                            batch_size=grid.batch_size, allow_long_context=grid.allow_long_context)
    return {c.name: (r, row_of(c, r, j.seconds)) for c, j, r in zip(cells, jobs, results)}


def device_here(device: str) -> str:
    """The name of the device ``device`` (``cpu`` or ``cuda``) decodes on here, as a cell records it."""
    import torch

    if device != "cuda":
        return "CPU"
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CUDA"


def run_cells(grid: Grid, todo: list[Cell], done: dict[str, Any], grids: dict[str, Any], model, tokenizer,
              samples) -> list[dict[str, Any]]:
    """Runs the cells of ``todo`` (none: only the rows of those ``done``), writing each cell's file as it is done
    and adding it to ``done``; returns the rows of every cell of the grid done, in the grid's order."""
    from tqdm import tqdm

    here, shared = device_here(grid.device), {}
    if grid.settings is not None and not grid.measure and grid.device == "cuda" and len(todo) > 1:
        print(f"{len(todo)} cells decode together: each batch is prefilled once for all of them", file=sys.stderr)
        shared = run_together(grid, todo, model, tokenizer, samples)
    # On a terminal one bar over the cells, the prompts' bars below it; in a log (no terminal) a line per cell
    # instead, since a bar below another moves the cursor up with escape codes a log keeps as text.
    terminal, running, rows = sys.stderr.isatty(), {c.name for c in todo}, []
    bar = tqdm(grid.cells, desc="quality grid", unit="cell", disable=not terminal)
    for number, cell in enumerate(bar, 1):
        if cell.name not in running:  # done before (its row is kept) or left out (summarising only)
            rows += [done[cell.name]["row"]] if cell.name in done else []
            continue
        bar.set_postfix_str(cell.name)
        result, row = shared.pop(cell.name) if cell.name in shared else run_cell(grid, cell, model, tokenizer, samples)
        row["device_name"] = " and ".join(result.get("devices") or [here])  # every GPU a resumed cell ran on
        done[cell.name] = {"grid": grids[cell.name], "cell": asdict(cell), "row": row, "result": result}
        write_cell(grid.out, cell.name, done[cell.name])
        partial_file(grid.out, cell).unlink(missing_ok=True)
        rows.append(row)
        if not terminal:
            print(f"quality grid: cell {number}/{len(grid.cells)} {cell.name} done", file=sys.stderr, flush=True)
    bar.close()
    return rows


def write_summary(grid: Grid, rows: list[dict[str, Any]], done: int, resumed_count: int, summarize: bool) -> None:
    """``summary.json``, ``TABLE.md`` and the plots from the ``rows`` of the ``done`` cells of the grid (a finished
    grid's cells packed into its archive, unless ``summarize``: then nothing ran), and what ran printed."""
    out, cells, reasoning = grid.out, len(grid.cells), grid.settings is None
    packed = done == cells and not summarize and pack(out)  # a finished grid
    names = [name for name in device_names(rows) if name]  # where the cells ran
    device_name = " and ".join(names) if names else device_here(grid.device)
    summary = {**grid.common(), "device_name": device_name, "budgets": grid.budgets, "mapping": MAPPING, "rows": rows}
    atomic.write_text(out / "summary.json", json.dumps(summary, separators=(",", ":"), default=str) + "\n")  # compact: TABLE.md is the one to read
    table = format_fidelity_table(summary) if reasoning else format_table(summary)
    atomic.write_text(out / "TABLE.md", table)
    plots = plot_fidelity(summary, out) if reasoning else plot(summary, out)
    print(table)
    ran = f"{cells - done} cells not done, left out" if summarize else f"{done - resumed_count} cells run"
    print(f"{ran}, {resumed_count} resumed from {out}; "
          f"wrote summary.json, TABLE.md, {', '.join(plots + [ARCHIVE] * packed)}")
