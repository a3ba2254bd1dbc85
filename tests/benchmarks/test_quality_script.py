"""The quality grid (``rolecall grid``, ``benchmarks/quality.py`` under its own name) end to end on a tiny model:
every policy at two budgets, consistent outputs, resuming; and its parts (:mod:`rolecall.eval.grid`, the tables)."""

import argparse
import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from rolecall.cli import main as rolecall_main
from rolecall.cli.grid import add_arguments, build_cells
from rolecall.core.manifest import ModelIdentity, RoleManifest
from rolecall.eval import grid, grid_tables, wilson_interval
from tests.benchmarks import load_benchmark, refusal
from tests.tiny import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def load_script():
    return load_benchmark("quality")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen2 model and tokenizer, three manifests for it, and a small haystack corpus."""
    folder = tmp_path_factory.mktemp("quality")
    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    model.generation_config.pad_token_id = 259
    model.save_pretrained(folder / "model")
    tiny_tokenizer().save_pretrained(folder / "model")
    identity = ModelIdentity.from_config(model.config)
    RoleManifest(identity, layer_role=torch.tensor([0, 1, 2, 2], dtype=torch.int8),
                 layer_budget=torch.tensor([1.0, 0.5, 0.25, 0.25])).save(folder / "delta.safetensors")
    RoleManifest(identity, head_role=torch.tensor([[1, 1], [0, 1], [0, 0], [1, 0]], dtype=torch.int8)).save(
        folder / "heads.safetensors")
    rng = np.random.default_rng(7)
    (folder / "books").mkdir()
    words = ("river", "stone", "lantern", "orchard", "meadow", "harbour", "quiet", "morning")
    for i in range(2):
        (folder / "books" / f"b{i}.txt").write_text(" ".join(words[j] for j in rng.integers(0, 8, size=600)) + ".")
    return folder


def test_grid_outputs_are_consistent_and_a_rerun_resumes(folder, tmp_path, capsys, cache_dir):
    quality = load_script()
    out = tmp_path / "out"
    argv = ["--model", str(folder / "model"), "--source", f"text:{folder / 'books'}", "--lengths", "400",
            "--depths", "0.2", "0.8", "--budgets", "32", "64", "--max-new-tokens", "4", "--device", "cpu",
            "--delta", str(folder / "delta.safetensors"), "--heads", f"kuma={folder / 'heads.safetensors'}",
            "--lethe", str(folder / "delta.safetensors"), "--vattention-epsilon", "0.5", "--out", str(out)]
    assert quality.main(argv) == 0
    captured = capsys.readouterr()
    printed = captured.out
    labels = ["full", "delta", "lychee-kuma", "lethe", "vattention", "quest"]
    names = ["full"] + [f"{label}-b{b}" for label in labels[1:] for b in (32, 64)]
    assert sorted(p.stem for p in (out / "cells").glob("*.json")) == sorted(names)
    assert not list((out / "cells").glob("*.partial.jsonl"))  # each batch checkpoint goes once its cell is written
    assert f"{len(names)} cells run, 0 resumed" in printed
    # not a terminal: a line per cell, no bar moving the cursor up over another
    done = [line for line in captured.err.splitlines() if line.startswith("quality grid: cell ")]
    assert len(done) == len(names) and done[-1].startswith(f"quality grid: cell {len(names)}/{len(names)} ")
    assert "\x1b[A" not in captured.err

    summary = json.loads((out / "summary.json").read_text())
    rows = {(r["label"], r["budget"]): r for r in summary["rows"]}
    assert len(rows) == len(names) and all(r["prompts"] == 2 for r in rows.values())
    full = rows[("full", None)]
    assert full["kl_mean"] < 1e-6 and full["top1_agreement"] == 1.0
    assert full["attended_fraction"] == pytest.approx(1.0) and full["recall_sparse_layers"] == pytest.approx(1.0)
    for (label, budget), r in rows.items():
        if label == "full":
            continue
        assert r["attended_fraction"] < 1 and r["recall_sparse_layers"] < 1 and r["kl_mean"] > 0, (label, budget)
        cell = json.loads((out / "cells" / f"{label}-b{budget}.json").read_text())
        assert cell["row"] == r and cell["result"]["kl_mean"] == r["kl_mean"]
    # The budget mapping reaches each policy's parameters; more budget reads more.
    assert rows[("delta", 32)]["params"] == {"budget": 32, "page_size": 16, "recent_pages": 1}
    assert rows[("quest", 64)]["params"] == {"budget": 64, "page_size": 16}
    for label in ("delta", "lychee-kuma", "lethe", "quest"):  # vAttention's CLT sample is not set by the budget
        assert rows[(label, 32)]["attended_fraction"] < rows[(label, 64)]["attended_fraction"], label

    table = (out / "TABLE.md").read_text()
    assert table in printed
    main_table = next(block for block in table.split("\n\n") if block.startswith("| policy | budget | score"))
    table_rows = [line for line in main_table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(table_rows) == len(names)
    paired = next(block for block in table.split("\n\n") if block.startswith("| policy | budget | − full"))
    assert len(paired.splitlines()) == 2 + len(names) - 1  # header, rule, every row but full
    assert table_rows[0].split(" | ")[:2] == ["| full", "–"] and "| 1.000 | 1.000 |" in table_rows[0]
    assert "quest: K = ceil(budget / 16) pages" in table
    assert (out / "quality.png").stat().st_size > 1000
    assert "python -m benchmarks.quality --model" in (out / "COMMAND.txt").read_text()

    # A rerun resumes every cell; a removed cell is the only one run again. --summarize first leaves it out
    # without loading any model.
    (out / "cells" / "quest-b32.json").unlink()
    import rolecall.core.models

    def no_load(*args, **kwargs):
        raise AssertionError("--summarize loaded a model")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rolecall.core.models, "load_model", no_load)
        assert quality.main([*argv, "--summarize"]) == 0
    assert "1 cells not done, left out" in capsys.readouterr().out
    partial = json.loads((out / "summary.json").read_text())["rows"]
    assert [r["label"] for r in partial].count("quest") == 1 and len(partial) == len(names) - 1
    assert "none of this command's 1 cells is done" in refusal(capsys, quality, [
        *argv[:argv.index("--budgets")], "--budgets", "48", *argv[argv.index("--budgets") + 3:], "--policies", "quest",
        "--summarize"])
    stamp = (out / "cells" / "delta-b32.json").stat().st_mtime_ns
    assert quality.main(argv) == 0
    assert f"1 cells run, {len(names) - 1} resumed" in capsys.readouterr().out
    assert (out / "cells" / "delta-b32.json").stat().st_mtime_ns == stamp
    assert json.loads((out / "summary.json").read_text())["rows"][0] == summary["rows"][0]
    assert len((out / "COMMAND.txt").read_text().splitlines()) == 3  # the two runs and the summary

    # The finished grid is packed into one file, which alone is the record: a folder holding it and no cells/
    # summarises to the same table and resumes every cell.
    packed = (out / "cells.jsonl.xz").read_bytes()
    assert grid.read_archive(out) == {p.stem: json.loads(p.read_text()) for p in (out / "cells").glob("*.json")}
    assert not grid.pack(out) and (out / "cells.jsonl.xz").read_bytes() == packed  # nothing new: left as it is
    record = tmp_path / "record"
    record.mkdir()
    shutil.copy(out / "cells.jsonl.xz", record)
    moved = [a if a != str(out) else str(record) for a in argv]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rolecall.core.models, "load_model", no_load)
        assert quality.main([*moved, "--summarize"]) == 0
    assert "0 cells not done, left out, 11 resumed" in capsys.readouterr().out
    assert (record / "TABLE.md").read_text() == (out / "TABLE.md").read_text()
    assert not list(record.glob("cells/*.json"))  # only summarised: nothing unpacked
    with pytest.MonkeyPatch.context() as mp:  # the same command twice in a row (re-summarised): recorded once
        mp.setattr(rolecall.core.models, "load_model", no_load)
        assert quality.main([*argv, "--summarize"]) == 0 and quality.main([*argv, "--summarize"]) == 0
    assert (out / "COMMAND.txt").read_text().splitlines()[-2:] == [
        f"python -m benchmarks.quality {shlex.join(argv)}", f"python -m benchmarks.quality {shlex.join([*argv, '--summarize'])}"]

    # Other prompts into the same folder are refused rather than mixed with the old cells.
    assert "made with other settings" in refusal(capsys, quality, [a if a != "0.8" else "0.5" for a in argv])
    assert len((out / "COMMAND.txt").read_text().splitlines()) == 4  # refused before anything was written

    # rolecall grid runs the same code: the same table from the same cells, its command line recorded as given
    table = (out / "TABLE.md").read_text()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rolecall.core.models, "load_model", no_load)
        assert rolecall_main(["grid", *argv, "--summarize"]) == 0
    assert (out / "TABLE.md").read_text() == table
    assert (out / "COMMAND.txt").read_text().splitlines()[-1] == f"rolecall grid {shlex.join([*argv, '--summarize'])}"

    # A cell written before a setting existed (absent from its file, unset now) is the same cell; one that
    # holds another value for it is not.
    cell = out / "cells" / "delta-b32.json"
    doc = json.loads(cell.read_text())
    assert doc["grid"]["settings"].pop("data") is None
    cell.write_text(json.dumps(doc))
    assert quality.main([*argv, "--summarize"]) == 0
    doc["grid"]["settings"]["data"] = "other.zip"
    cell.write_text(json.dumps(doc))
    assert "delta-b32.json was made with other settings" in refusal(capsys, quality, [*argv, "--summarize"])


def test_missing_manifest_and_bad_heads_are_one_line_errors(folder, tmp_path, capsys):
    quality = load_script()
    base = ["--model", str(folder / "model"), "--out", str(tmp_path / "o")]
    assert "policy delta needs --delta" in refusal(capsys, quality, [*base, "--policies", "delta"])
    assert "write it as NAME=PATH" in refusal(capsys, quality, [*base, "--heads", "nopath"])
    assert "unknown policy 'dense'" in refusal(capsys, quality, [*base, "--policies", "dense"])
    assert "write it as POLICY:KEY=VALUE" in refusal(capsys, quality, [*base, "--variant", "dense:per_head=true"])
    err = refusal(capsys, quality, [*base, "--policies", "lethe", "--lethe", str(tmp_path / "absent.safetensors")])
    assert re.search(r"lethe-b\d+: no manifest file at .*absent.safetensors; give the path", err)
    assert refusal(capsys, quality, [*base, "--device", "cpu", "--batch-size", "2"]) == (
        "quality.py: error: --batch-size 2: the CPU runs the transformers path, which decodes one prompt at a time; "
        "leave --batch-size out or pass 1 (`quality.py --help` lists the options)")
    assert not (tmp_path / "o").exists()  # refused before anything was written
    with pytest.raises(SystemExit) as stop:  # rolecall grid: the same checks, as its own usage errors
        rolecall_main(["grid", *base, "--policies", "delta"])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        "rolecall grid: error: policy delta needs --delta (or --delta-recall); give the manifest or leave delta out "
        "of --policies (`rolecall grid --help` lists the options)\n")
    assert "per_head must be true or false" in refusal(capsys, quality, [
        *base, "--policies", "delta", "--delta", str(folder / "delta.safetensors"), "--variant", "delta:per_head=maybe"])


def test_a_manifest_its_cell_cannot_use_stops_the_grid_before_the_model_loads(folder, tmp_path, monkeypatch, capsys):
    """Every cell is checked against the model's config and its policy first: a heads manifest given as DELTA's,
    or a manifest of another model, stops the grid in one line before anything is written or loaded."""
    import rolecall.core.models

    def refuse(*a, **k):
        raise AssertionError("the model was loaded for a grid that should have been refused")

    monkeypatch.setattr(rolecall.core.models, "load_model", refuse)
    quality = load_script()
    base = ["--model", str(folder / "model"), "--out", str(tmp_path / "o"), "--budgets", "32"]
    assert refusal(capsys, quality, [*base, "--policies", "delta", "--delta", str(folder / "heads.safetensors")]).startswith(
        "quality.py: error: delta-b32: policy 'delta' needs a manifest with a layers section")
    other = tiny_model("qwen2", layers=3, heads=4, kv_heads=2, head_dim=16)
    RoleManifest(ModelIdentity.from_config(other.config), layer_role=torch.tensor([0, 1, 2], dtype=torch.int8)).save(
        tmp_path / "other.safetensors")
    assert refusal(capsys, quality, [*base, "--policies", "delta", "--delta", str(tmp_path / "other.safetensors")]).startswith(
        "quality.py: error: delta-b32: manifest does not fit this model: model.num_layers is 3")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flags, says", [
    (["--lengths", "1000", "0"], "--lengths must be at least 1 each, got 1000 0 (`quality.py --help`"),
    (["--depths", "0.5", "1.5"], "--depths takes places in the context from 0 (its start) to 1 (its end), got 0.5 1.5"),
    (["--budgets", "0"], "--budgets must be at least 1 each, got 0"),
    (["--suite", "reasoning", "--limit", "0"], "--limit must be at least 1, got 0"),
    (["--suite", "reasoning", "--max-new-tokens", "1"],
     "--max-new-tokens must be at least 2 (the first token comes from the dense prefill), got 1"),
    (["--source", "text:{tmp}/absent"], "--source: text:{tmp}/absent: no such file or folder; pass text:"),
    (["--source", "nosuch"], "--source: unknown corpus 'nosuch'; choose one of: pg-essays"),
    (["--suite", "longbench", "--tasks", "musique", "--data", "{tmp}/absent.zip"],
     "--data {tmp}/absent.zip: no such file or folder; pass LongBench's data.zip"),
    (["--suite", "reasoning", "--reasoning-source", "jsonl:{tmp}/absent.jsonl"],
     "--reasoning-source: reasoning source jsonl:{tmp}/absent.jsonl: no such file; pass jsonl:"),
    (["--lengths", "5000"], "--lengths: 5000 + 4 new tokens exceeds the model's 4096 positions; use shorter lengths"),
])
def test_prompt_flags_are_refused_before_anything_loads_or_is_written(folder, tmp_path, monkeypatch, capsys, flags,
                                                                         says):
    """Lengths, depths, budgets and the prompts' sources (a corpus, LongBench's copy, reasoning prompts): one line,
    exit status 2, before the tokenizer or the weights load and before --out is made."""
    import rolecall.core.models

    def refuse(*a, **k):
        raise AssertionError("loaded before the flags were checked")

    monkeypatch.setattr(rolecall.core.models, "load_model", refuse)
    monkeypatch.setattr(rolecall.core.models, "load_tokenizer", refuse)
    quality = load_script()
    argv = ["--model", str(folder / "model"), "--device", "cpu", "--policies", "full", "quest", "--budgets", "32",
            "--max-new-tokens", "4", *[f.format(tmp=tmp_path) for f in flags], "--out", str(tmp_path / "o")]
    assert says.format(tmp=tmp_path) in refusal(capsys, quality, argv)
    assert not (tmp_path / "o").exists()


def test_variants_add_rows_with_their_parameters_on_top_of_the_budgets(folder):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", "o", "--policies", "full", "delta", "--delta", "a.safetensors", "--delta-recall",
                              "b.safetensors", "--budgets", "256", "1024", "--variant", "delta:per_head=true,num_pages=9"])
    cells = build_cells(args)
    names = [c.name for c in cells]
    assert names == ["full", "delta-b256", "delta-b1024", "delta-per_head-num_pages9-b256",
                     "delta-per_head-num_pages9-b1024", "delta-recall-b256", "delta-recall-b1024",
                     "delta-recall-per_head-num_pages9-b256", "delta-recall-per_head-num_pages9-b1024"]
    plain, variant = cells[2], cells[4]
    args = parser.parse_args(["--out", "o", "--policies", "vattention", "--delta", "a.safetensors", "--budgets", "256",
                              "--combined"])
    combined = build_cells(args)
    assert [(c.name, c.policy, c.manifest) for c in combined] == [
        ("vattention-b256", "vattention", None), ("vattention-delta-b256", "vattention", "a.safetensors")]
    with pytest.raises(ValueError, match="--combined runs vAttention on a DELTA manifest"):
        build_cells(parser.parse_args(["--out", "o", "--policies", "vattention", "--combined"]))
    assert plain.params == {"budget": 1024, "page_size": 16, "recent_pages": 8}
    assert variant.params == {**plain.params, "per_head": True, "num_pages": 9} and variant.manifest == "a.safetensors"


def test_longbench_grid_runs_from_a_local_copy(folder, tmp_path, capsys, cache_dir):
    quality = load_script()
    data = tmp_path / "longbench"
    data.mkdir()
    rows = [{"input": f"q{i}", "context": "river stone lantern " * 40, "answers": ["river"], "_id": str(i)}
            for i in range(3)]
    (data / "musique.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "lb"
    assert quality.main(["--model", str(folder / "model"), "--suite", "longbench", "--data", str(data), "--tasks",
                         "musique", "--lengths", "150", "--samples-per-cell", "2", "--policies", "full", "quest",
                         "--budgets", "32", "--device", "cpu", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["label"], r["prompts"], set(r["tasks"])) for r in summary["rows"]] == [
        ("full", 2, {"musique"}), ("quest", 2, {"musique"})]
    assert "LongBench (musique), the first 2 of each task cut to 150 tokens" in (out / "TABLE.md").read_text()


def test_ruler_suite_grid_reports_intervals_per_task(folder, tmp_path, capsys, cache_dir):
    quality = load_script()
    out = tmp_path / "ruler"
    argv = ["--model", str(folder / "model"), "--source", f"text:{folder / 'books'}", "--suite", "ruler", "--tasks",
            "niah_single_noise", "variable_tracking", "--lengths", "300", "--samples-per-cell", "2", "--policies",
            "full", "quest", "--budgets", "32", "--device", "cpu", "--out", str(out)]
    assert quality.main(argv) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    for r in summary["rows"]:
        assert r["prompts"] == 4 and r["score"]["n"] == 4
        low, high = r["score"]["interval"]
        assert low <= r["score"]["score"] <= high
        assert set(r["tasks"]) == {"niah_single_noise", "variable_tracking"}
        assert all(cell["n"] == 2 for cell in r["tasks"].values())
    table = (out / "TABLE.md").read_text()
    assert "Per task (score [95 %]" in table and "| niah_single_noise | variable_tracking |" in table
    # a length too short for a task's question: one line naming the length and the fix, no cell run
    short = [a if a != "300" else "10" for a in argv]
    short[short.index(str(out))] = str(tmp_path / "short")
    assert quality.main(short) == 2  # the prompts' bar is left on the line the error follows
    assert re.search(r"quality.py: error: length 10 leaves -\d+ tokens for the \w+ text; use lengths of at least",
                     capsys.readouterr().err)
    assert not list((tmp_path / "short").glob("cells/*.json"))
    assert "RULER-style suite (niah_single_noise, variable_tracking)" in table and "prompts/s" in table
    for name in ("quality.png", "quality-tasks.png"):
        assert (out / name).stat().st_size > 1000 and name in printed
    # each prompt's score is kept, so the table pairs quest with full over the very same prompts
    full, quest = summary["rows"]
    assert len(full["scores"]) == len(quest["scores"]) == 4
    from rolecall.eval import paired_difference

    d = paired_difference(quest["scores"], full["scores"])
    assert "Paired differences over the same prompts" in table
    assert f"| quest | 32 | {d['mean']:+.3f} [{d['interval'][0]:+.3f}, {d['interval'][1]:+.3f}]" in table
    # a finished grid is summarised again on any machine: here cells marked as a GPU run's, on a machine that may
    # have no GPU; no model loads (the model folder is gone) and the device named is the one the cells ran on
    for path in (out / "cells").glob("*.json"):
        cell = json.loads(path.read_text())
        cell["grid"].update(device="cuda", dtype="bfloat16")
        cell["row"]["device_name"] = "NVIDIA H200"
        path.write_text(json.dumps(cell))
    (out / "TABLE.md").unlink()
    shutil.move(folder / "model", tmp_path / "away")
    try:
        assert quality.main([*argv[:-4], "--device", "cuda", "--out", str(out)]) == 0
    finally:
        shutil.move(tmp_path / "away", folder / "model")
    assert "NVIDIA H200, bfloat16" in (out / "TABLE.md").read_text()
    assert "unknown RULER task" in refusal(capsys, quality, [*argv[:-2], "--tasks", "nope", "--out", str(tmp_path / "x")])


def test_reasoning_grid_reports_kl_with_bootstrap_intervals(folder, tmp_path, capsys, cache_dir):
    quality = load_script()
    out = tmp_path / "fidelity"
    argv = ["--model", str(folder / "model"), "--suite", "reasoning", "--reasoning-source", "arithmetic:3", "--limit",
            "3", "--max-new-tokens", "24", "--policies", "full", "delta", "quest", "--budgets", "16", "32",
            "--delta", str(folder / "delta.safetensors"), "--device", "cpu", "--out", str(out)]
    assert quality.main(argv) == 0
    printed = capsys.readouterr().out
    rows = {(r["label"], r["budget"]): r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert set(rows) == {("full", None), ("delta", 16), ("delta", 32), ("quest", 16), ("quest", 32)}
    assert rows[("full", None)]["kl_mean"] == 0.0 and rows[("full", None)]["never_diverged"] == 1.0
    for key, r in rows.items():
        assert r["prompts"] == 3
        if key[0] != "full":
            low, high = r["kl_interval"]
            assert low <= r["kl_mean"] <= high and r["kl_mean"] > 0, key
    assert "## Reasoning fidelity" in printed and (out / "fidelity.png").stat().st_size > 1000
    assert quality.main(argv) == 0 and "0 cells run, 5 resumed" in capsys.readouterr().out
    from rolecall.runtime.policies import engine_policies

    assert set(engine_policies()) == {"full", "delta", "lychee", "lethe", "vattention", "quest"}  # none left out


def test_cells_run_together_prefill_each_batch_once(folder, tmp_path, cache_dir, monkeypatch):
    """What the grid does on a GPU (here the engine on the CPU): the cells still to run decode each batch from
    one prefill, every cell keeps its own checkpoint, and each row gets its own time."""
    from rolecall.cli.common import eval_settings
    from rolecall.core.models import load_model, load_tokenizer
    from rolecall.eval import suite_prompts
    from rolecall.runtime.engine import StaticDecoder

    out = tmp_path / "out"
    (out / "cells").mkdir(parents=True)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(folder / "model"), "--source", f"text:{folder / 'books'}", "--lengths",
                              "400", "--depths", "0.2", "0.8", "--budgets", "32", "--max-new-tokens", "4", "--device",
                              "cpu", "--delta", str(folder / "delta.safetensors"), "--policies", "full", "delta",
                              "quest", "--batch-size", "2", "--out", str(out)])
    settings, cells = eval_settings(args), build_cells(args)
    for cell in cells:
        cell.params["engine"] = "static"
    model, tok = load_model(str(folder / "model")), load_tokenizer(str(folder / "model"))
    samples = suite_prompts(tok, settings)
    prefill, calls = StaticDecoder.prefill, []
    monkeypatch.setattr(StaticDecoder, "prefill", lambda self, *a, **k: (calls.append(1), prefill(self, *a, **k))[1])
    done = grid.run_together(grid.Grid(args.model, out, cells, args.budgets, settings, batch_size=2), cells, model,
                             tok, samples)
    assert len(samples) == 2 and len(calls) == 1  # one batch, prefilled once for three cells
    assert sorted(done) == ["delta-b32", "full", "quest-b32"]
    for cell in cells:
        result, row = done[cell.name]
        assert row["prompts"] == 2 and row["wall_s"] > 0 and row["label"] == cell.label
        assert grid.partial_file(out, cell).exists()


def test_cells_record_manifest_paths_relative_to_the_working_directory(tmp_path, monkeypatch):
    """A grid run with absolute manifest paths records them relative to where it runs, so its files name no
    machine's folders; paths outside the working directory and relative ones stay as given."""
    monkeypatch.chdir(tmp_path)
    assert grid.shown_path(str(tmp_path / "artifacts" / "m.safetensors")) == str(Path("artifacts") / "m.safetensors")
    assert grid.shown_path("artifacts/m.safetensors") == "artifacts/m.safetensors"
    outside = str(tmp_path.parent / "elsewhere.safetensors")
    assert grid.shown_path(outside) == outside
    assert grid.shown_path(None) is None


def test_a_grid_resumed_on_another_gpu_names_each_cells_gpu():
    """Cells that ran on different GPUs: the table names each cell's GPU beside its wall time (a cell resumed on
    another GPU, both); one GPU: no mark."""
    assert grid_tables.short_gpu("NVIDIA H100 80GB HBM3") == "H100" and grid_tables.short_gpu("NVIDIA H200") == "H200"
    assert grid_tables.short_gpu("NVIDIA A100-SXM4-80GB") == "A100" and grid_tables.short_gpu(None) == "?"
    row = {"label": "full", "policy": "full", "budget": None, "score": None, "recall_sparse_layers": None,
           "kl_mean": None, "top1_agreement": None, "attended_fraction": 1.0, "wall_s": 2.0, "prompts": 1,
           "manifest": None, "tasks": {}, "device_name": "NVIDIA H200"}
    summary = {"model": "m", "settings": {"suite": "prompts", "prompts": "p.jsonl"}, "dtype": "bfloat16",
               "device_name": "NVIDIA H200", "rows": [row, {**row, "label": "quest", "budget": 256}]}
    assert "2.0 |" in grid_tables.format_table(summary) and "(H100)" not in grid_tables.format_table(summary)
    summary["rows"][1]["device_name"] = "NVIDIA H100 80GB HBM3"
    table = grid_tables.format_table(summary)
    assert "| 2.0 (H200) |" in table and "| 2.0 (H100) |" in table and "beside it" in table
    assert grid_tables.device_names(summary["rows"]) == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    del summary["rows"][1]["device_name"]  # a cell that recorded none: "?" beside it, not taken for the other GPU
    assert grid_tables.device_names(summary["rows"]) == ["NVIDIA H200", None] and "| 2.0 (?) |" in grid_tables.format_table(summary)
    summary["rows"][1]["device_name"] = "NVIDIA H100 80GB HBM3 and NVIDIA H200"  # one cell resumed on another GPU
    assert "| 2.0 (H100 + H200) |" in grid_tables.format_table(summary)
    assert grid_tables.device_names(summary["rows"]) == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]


def test_a_resumed_cells_wall_time_counts_every_run():
    """A cell resumed over two runs: ``wall_s`` is the last run's; its batches' recorded seconds hold both runs,
    and the table's wall column and the grid's total give those (a cell without them: its ``wall_s``)."""
    row = {"label": "delta", "policy": "delta", "budget": 1024, "score": None, "recall_sparse_layers": None,
           "kl_mean": None, "top1_agreement": None, "attended_fraction": 0.2, "wall_s": 15.0, "prompts": 10,
           "manifest": None, "tasks": {}, "seconds": {"batches": 4, "setup": 1.0, "prefill": 60.0, "capture": 5.0,
                                                       "decode": 10.0, "reference": 2.0, "other": 2.0, "total": 80.0}}
    old = {**row, "label": "full", "policy": "full", "budget": None, "seconds": None, "wall_s": 20.0}
    assert grid_tables.wall_of(row) == 80.0 and grid_tables.wall_of(old) == 20.0
    table = grid_tables.format_table({"model": "m", "settings": {"suite": "prompts", "prompts": "p.jsonl"}, "dtype": "bfloat16",
                            "device_name": "CPU", "rows": [old, row]})
    assert "| 80.0 |" in table and "| 20.0 |" in table and "| 15.0 |" not in table
    assert "20 prompts, 100 s of evaluation in all (0.20 prompts/s)" in table


def test_table_gives_each_rows_score_per_length_and_the_kv_it_held():
    """Per length: each row's score over every task of that length, pooled with its Wilson interval (the full
    row: the ceiling per length); the KV column: MB per prompt where the engine recorded it."""
    cell = lambda score, n: {"score": score, "n": n}  # noqa: E731
    row = {"label": "full", "policy": "full", "budget": None, "score": None, "recall_sparse_layers": None,
           "kl_mean": None, "top1_agreement": None, "attended_fraction": 1.0, "wall_s": 2.0, "prompts": 40,
           "manifest": None, "tasks": {}, "kv_bytes_per_prompt": 12.5e6,
           "task_lengths": {"a": {"1024": cell(1.0, 10), "2048": cell(0.5, 10)},
                            "b": {"1024": cell(0.0, 10), "2048": cell(0.5, 10)}}}
    summary = {"model": "m", "settings": {"suite": "prompts", "prompts": "p.jsonl"}, "dtype": "bfloat16",
               "device_name": "CPU", "rows": [row]}
    table = grid_tables.format_table(summary)
    lo, hi = wilson_interval(10, 20)
    assert f"| full | – | 0.500 [{lo:.3f}, {hi:.3f}] | 0.500 [{lo:.3f}, {hi:.3f}] |" in table
    assert "| 12.5 | 2.0 |" in table
    one_length = {**row, "task_lengths": {"a": {"1024": cell(1.0, 10)}}, "kv_bytes_per_prompt": None}
    table = grid_tables.format_table({**summary, "rows": [one_length]})
    assert "Per length" not in table and "| – | 2.0 |" in table
