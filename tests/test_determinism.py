"""Manifests are a function of the inputs alone (no clock, no absolute paths), a resumed run equals an
uninterrupted one byte for byte, a run owns its checkpoint folder, and sidecars appear only with a manifest.

Every test runs the real ``train-heads`` / ``calibrate-delta`` entry points on tiny models for a few steps."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rolecall.calibrate import cli as calibrate_cli
from rolecall.core.manifest import ModelIdentity, RoleManifest, read_metadata
from rolecall.train import checkpoint as ckpt
from rolecall.train.cli import main as train_main
from tests.tiny import tiny_folder, tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("tiny-llama"), "llama", layers=2, heads=4, kv_heads=2)


def _write_data(path: Path) -> Path:
    g = torch.Generator().manual_seed(5)
    lines = []
    for n in (48, 56, 40):
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        lines.append(json.dumps({"input_ids": ids, "labels": [-100] * (n - 6) + ids[n - 6 :]}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _args(model_dir, data, out, *extra, steps=6, plots=False):
    return ["--model", str(model_dir), "--dataset", str(data), "--output", str(out), "--target", "1",
            "--steps", str(steps), "--checkpoint-every", "2", "--prefill-chunk", "16", "--device", "cpu",
            *([] if plots else ["--no-plots"]), "--lr", "0.05", "--lambda-lr", "0.1", *extra]


def _last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """One uninterrupted train-heads run: (its folder, its manifest's bytes)."""
    folder = tmp_path_factory.mktemp("reference")
    out = folder / "out" / "heads.safetensors"
    assert train_main(_args(model_dir, _write_data(folder / "data" / "data.jsonl"), out)) == 0
    return folder, out.read_bytes()


def test_two_train_runs_in_other_folders_write_identical_bytes(model_dir, reference, tmp_path):
    first_folder, first = reference
    # another output folder and another copy of the data, deeper, elsewhere: only names and contents matter
    out = tmp_path / "x" / "y" / "heads.safetensors"
    assert train_main(_args(model_dir, _write_data(tmp_path / "elsewhere" / "data.jsonl"), out)) == 0
    assert out.read_bytes() == first
    meta = read_metadata(first)
    assert "created" not in meta
    header = json.dumps(meta)
    for folder in (first_folder, tmp_path):
        assert str(folder) not in header
    m = RoleManifest.load(out)
    assert "created" not in read_metadata(out.read_bytes())  # no wall-clock time in a manifest
    assert m.config["output"] == "heads.safetensors" and m.config["dataset"] == "data.jsonl"
    assert m.data["path"] == "data.jsonl" and len(m.data["sha256"]) == 64
    # the sidecar config is for re-running here: it keeps the paths as given
    assert json.loads((out.parent / "heads.config.json").read_text())["output"] == str(out)


def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_bytes(model_dir, reference, tmp_path, capsys):
    _, first = reference
    out, data = tmp_path / "run" / "heads.safetensors", _write_data(tmp_path / "data.jsonl")
    # a real kill -9 right after the checkpoint of step 4 (of 6) is on disk: nothing after it runs
    script = textwrap.dedent(f"""
        import os, signal, sys
        from rolecall.train import checkpoint
        save = checkpoint.save_checkpoint
        def save_then_die(path, state):
            save(path, state)
            if state["step"] == 4:
                os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.save_checkpoint = save_then_die
        from rolecall.train.cli import main
        sys.exit(main({_args(model_dir, data, out)!r}))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not out.exists() and not (out.parent / "heads.config.json").exists()  # no sidecar without a manifest
    assert sorted(p.name for p in ckpt.checkpoint_dir(out).iterdir()) == ["log.jsonl", "step-0000002.pt",
                                                                          "step-0000004.pt"]
    # starting afresh over it is refused; --resume continues it
    assert train_main(_args(model_dir, data, out)) == 2
    assert "is taken" in _last_error(capsys)
    assert train_main(_args(model_dir, data, out, "--resume")) == 0
    assert out.read_bytes() == first
    log = [json.loads(line) for line in (out.parent / "heads.log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(6))


def test_resume_takes_only_a_checkpoint_of_the_same_run(model_dir, tmp_path, capsys):
    out, data = tmp_path / "heads.safetensors", _write_data(tmp_path / "data.jsonl")
    assert train_main(_args(model_dir, data, out, "--lr", "0.02")) == 0  # checkpoints at 2 and 4
    old_config = (tmp_path / "heads.config.json").read_bytes()
    # a fresh run into the same output: one line that asks for --overwrite, nothing touched
    assert train_main(_args(model_dir, data, out, steps=4)) == 2
    line = _last_error(capsys)
    assert line.startswith("train-heads: error: output ") and "--overwrite" in line and "\n" not in line
    assert (tmp_path / "heads.config.json").read_bytes() == old_config
    assert ckpt.latest_checkpoint(out).name == "step-0000004.pt"
    # --overwrite swaps the old checkpoints out at this run's first one: only its step 2 is left to resume from
    assert train_main(_args(model_dir, data, out, "--overwrite", steps=4)) == 0
    assert sorted(p.name for p in ckpt.checkpoint_dir(out).glob("step-*.pt")) == ["step-0000002.pt"]
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(out))
    assert len(state["run_id"]) == 64 and "created" not in state
    fresh = out.read_bytes()
    assert train_main(_args(model_dir, data, out, "--resume", steps=4)) == 0
    assert out.read_bytes() == fresh
    # the older run's settings: its one-line refusal names the checkpoint folder and what differs
    assert train_main(_args(model_dir, data, out, "--resume", "--lr", "0.02", steps=4)) == 2
    assert _last_error(capsys) == (
        f"train-heads: error: checkpoint in {ckpt.checkpoint_dir(out)} belongs to another run (lr is 0.05 in the "
        "checkpoint but 0.02 now); use a new --output or --overwrite")
    assert train_main(_args(model_dir, data, out, "--resume", "--overwrite", steps=4)) == 2
    assert "pass one of them" in _last_error(capsys)


def test_a_failing_run_leaves_the_good_manifest_and_its_sidecars_alone(model_dir, tmp_path, monkeypatch, capsys):
    out, data = tmp_path / "heads.safetensors", _write_data(tmp_path / "data.jsonl")
    assert train_main(_args(model_dir, data, out, steps=4, plots=True)) == 0
    names = ["heads.safetensors", "heads.config.json", "heads.log.jsonl", "heads.gates.png", "heads.curves.png"]
    before = {n: (tmp_path / n).read_bytes() for n in names}

    from rolecall.train import recipe

    real, calls = recipe.distill_loss, []

    def nan_at_step_3(*a, **kw):  # the loss goes bad after the checkpoint of step 2
        calls.append(1)
        loss, seen = real(*a, **kw)
        return (loss * float("nan"), seen) if len(calls) > 3 else (loss, seen)

    monkeypatch.setattr(recipe, "distill_loss", nan_at_step_3)
    assert train_main(_args(model_dir, data, out, "--overwrite", "--lr", "0.03", steps=4, plots=True)) == 2
    assert "step 3: distillation loss holds 1 non-finite" in _last_error(capsys)
    assert {n: (tmp_path / n).read_bytes() for n in names} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary files left
    # its history is kept beside its checkpoints
    assert [json.loads(x)["step"] for x in (tmp_path / "heads.ckpt" / "log.jsonl").read_text().splitlines()] == [0, 1, 2]


CAL = ["--page-size", "4", "--num-pages", "3", "--recent-pages", "2", "--warmup", "1", "--num-delta", "2",
       "--min-gap", "1", "--bins", "3", "--stride", "6", "--min-context", "40", "--device", "cpu", "--quiet",
       "--no-plots"]


def test_two_calibrations_from_trace_files_elsewhere_write_identical_bytes(tmp_path):
    folder = tmp_path / "qwen2"
    tiny_model("qwen2", layers=4, heads=4, kv_heads=2, seed=7).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    g = torch.Generator().manual_seed(3)
    text = "".join(json.dumps({"ids": torch.randint(0, 256, (n,), generator=g).tolist()}) + "\n" for n in (90, 110))
    outs = []
    for where in ("a", "b/c"):
        traces = tmp_path / where / "traces" / "t.jsonl"
        traces.parent.mkdir(parents=True)
        traces.write_text(text)
        model = tmp_path / where / "models" / "qwen2"  # the same model folder, elsewhere on each machine
        shutil.copytree(folder, model)
        out = tmp_path / where / "out" / "m.delta.safetensors"
        assert calibrate_cli.main(["--model", str(model), "--traces", str(traces), "--output", str(out), *CAL]) == 0
        outs.append((out, traces))
    (a, traces_a), (b, _) = outs
    assert a.read_bytes() == b.read_bytes()
    meta = read_metadata(a.read_bytes())
    assert "created" not in meta and str(tmp_path) not in json.dumps(meta)
    m = RoleManifest.load(a)
    assert m.model.name == "qwen2" and m.config["model"] == "qwen2"  # a local folder by its name
    assert m.config["traces"] == "t.jsonl" and m.data["source"] == "file:t.jsonl" and len(m.data["sha256"]) == 64
    saved = json.loads((a.parent / "m.delta.config.json").read_text())
    assert saved["traces"] == str(traces_a) and saved["output"] == str(a)  # the sidecar re-runs from here


def test_a_key_rolecall_does_not_know_is_kept_and_never_added():
    """An older file's ``created`` (a wall-clock time rolecall no longer writes) is metadata like any unknown key:
    kept as it came, so the round trip keeps the bytes; a new manifest has none."""
    model = ModelIdentity(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, name="tiny")
    old = RoleManifest(model, head_role=torch.ones(2, 2, dtype=torch.int8), extra={"created": "2024-05-01T12:00:00Z"})
    buf = old.to_bytes()
    loaded = RoleManifest.from_bytes(buf)
    assert loaded.extra == {"created": "2024-05-01T12:00:00Z"} and loaded.to_bytes() == buf
    new = RoleManifest(model, head_role=torch.ones(2, 2, dtype=torch.int8))
    assert "created" not in read_metadata(new.to_bytes())


def test_run_id_depends_on_what_decides_the_numbers_only(tmp_path):
    from rolecall.train.config import TrainConfig
    from rolecall.train.recipe import run_id

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    data = {"sha256": "0" * 64}
    base = dict(model="a", target=1, steps=6, output=str(tmp_path / "a" / "h.safetensors"))
    rid = run_id(TrainConfig(**base), data, model)
    assert rid == run_id(TrainConfig(**base), data, model)
    # what may change on resume, or where files lie, does not change the run
    for same in ({"steps": 9}, {"output": str(tmp_path / "b" / "h.safetensors")}, {"checkpoint_every": 7}):
        assert run_id(TrainConfig(**{**base, **same}), data, model) == rid
    for other in ({"lr": 0.5}, {"seed": 1}, {"target": 2}):
        assert run_id(TrainConfig(**{**base, **other}), data, model) != rid
    assert run_id(TrainConfig(**base), {"sha256": "1" * 64}, model) != rid
