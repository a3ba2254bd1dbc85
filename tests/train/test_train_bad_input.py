"""``train-heads`` on input it cannot use (issue #59): nothing already written is lost, no traceback, and every
refusal that does not need the weights comes before the model loads, in one line naming the flag, the value and
the fix. A 2-layer tiny model folder, as in test_train_cli.py."""

import json

import pytest
import torch

from rolecall.core.manifest import RoleManifest
from rolecall.train import checkpoint as ckpt
from rolecall.train.cli import main
from tests import refused_line, usage_error
from tests.tiny import tiny_folder, tiny_model, tiny_tokenizer

HELP = "(`train-heads --help` lists the options)"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("tiny-model"), "llama", layers=2, heads=4, kv_heads=2)


def _write_data(path, labelled=(True, True)):
    """Two samples of 48 and 56 tokens whose last 6 are the targets; a False in ``labelled`` leaves that
    sample's labels all -100."""
    g = torch.Generator().manual_seed(5)
    lines = []
    for n, keep in zip((48, 56), labelled):
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        labels = [-100] * (n - 6) + (ids[n - 6 :] if keep else [-100] * 6)
        lines.append(json.dumps({"input_ids": ids, "labels": labels}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def data_file(tmp_path):
    return _write_data(tmp_path / "data.jsonl")


def _args(model_dir, data_file, out, *extra):
    return ["--model", str(model_dir), "--dataset", str(data_file), "--output", str(out), "--target", "1",
            "--steps", "4", "--checkpoint-every", "2", "--prefill-chunk", "16", "--device", "cpu", "--no-plots",
            "--lambda-lr", "0.1", *extra]


def _files(folder) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) by its relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- numeric flags: refused as usage errors, at parse time -----------------------------------------------------

@pytest.mark.parametrize("flag,value,says", [
    ("--lr", "inf", "'inf' is not a finite number; pass a finite rate in (0, 10], e.g. 0.01"),
    ("--lr", "nan", "'nan' is not a finite number; pass a finite rate in (0, 10], e.g. 0.01"),
    ("--lr", "0", "'0' is out of range; pass a finite rate in (0, 10], e.g. 0.01"),
    ("--lr", "50", "'50' is out of range; pass a finite rate in (0, 10], e.g. 0.01"),
    ("--lambda-lr", "1e38", "'1e38' is out of range; pass a finite rate in (0, 1e6], e.g. 3.0"),
    ("--lambda-lr", "-1", "'-1' is out of range; pass a finite rate in (0, 1e6], e.g. 3.0"),
    ("--lambda-lr", "infinity", "'infinity' is not a finite number; pass a finite rate in (0, 1e6], e.g. 3.0"),
    ("--min-gate-prob", "nan", "'nan' is not a probability in [0, 0.5); pass e.g. 0.01, or 0 to turn the bound off"),
    ("--token-budget", "nan", "'nan' is no fraction of the sequence; pass a fraction in (0, 1] (0.3) or a whole "
                              "token count (4096)"),
    ("--token-budget", "inf", "'inf' is no fraction of the sequence; pass a fraction in (0, 1] (0.3) or a whole "
                              "token count (4096)"),
    ("--token-budget", "0", "'0' is no token count; pass a count >= 1 (4096) or a fraction in (0, 1] (0.3)"),
])
def test_a_numeric_flag_out_of_range_is_a_usage_error(model_dir, data_file, tmp_path, capsys, no_frozen_model, flag, value,
                                                       says):
    assert usage_error(capsys, main, _args(model_dir, data_file, tmp_path / "h.safetensors", flag, value)) == (
        f"train-heads: error: argument {flag}: {says} {HELP}")
    assert not (tmp_path / "h.ckpt").exists()


def test_a_rate_out_of_range_in_the_yaml_is_refused_before_the_model_loads(model_dir, data_file, tmp_path, capsys,
                                                                          no_frozen_model):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("lr: .inf\n")
    assert main(_args(model_dir, data_file, tmp_path / "h.safetensors", "--config", str(yaml_file))) == 2
    assert refused_line(capsys) == "train-heads: error: lr inf is not a finite number; give a finite rate in (0, 10], e.g. 0.01"
    yaml_file.write_text("lambda_lr: 1.0e+38\n")  # the flag --lambda-lr 0.1 of _args would win over the file
    args = [a for a in _args(model_dir, data_file, tmp_path / "h.safetensors", "--config", str(yaml_file))
            if a not in ("--lambda-lr", "0.1")]
    assert main(args) == 2
    assert refused_line(capsys) == ("train-heads: error: lambda_lr 1e+38 is out of range; give a finite rate in (0, 1e6], "
                                "e.g. 3.0")


@pytest.mark.parametrize("budget", ["100000", "56", "1.0"])
def test_a_token_budget_that_keeps_every_token_is_refused_before_the_model_loads(model_dir, data_file, tmp_path,
                                                                                capsys, no_frozen_model, budget):
    """The student reads 47 and 55 keys at the two samples' last targets: a budget of 55 or more (or the fraction
    1.0) makes every sparse head a full one, and the run would train on rounding noise."""
    assert main(_args(model_dir, data_file, tmp_path / "h.safetensors", "--token-budget", budget)) == 2
    assert refused_line(capsys) == (
        f"train-heads: error: --token-budget {budget} keeps every token of every sample (the longest, sample 2 of "
        f"{data_file}, reads 55 keys at its last target): sparse heads would read what full ones read and no gate "
        "could learn; pass a count below 55 or a fraction below 1 such as 0.3")


def test_a_budget_below_the_longest_sample_is_taken():
    from rolecall.train.config import check_budget

    check_budget(54, [47, 55], "sample {n}")  # sample 2 still has keys to leave out
    check_budget(0.9, [47, 55], "sample {n}")  # ceil(0.9 · 55) = 50 keys
    with pytest.raises(ValueError, match=r"^--token-budget 55 keeps every token of every sample \(the longest, "
                                         r"sample 2, reads 55 keys"):
        check_budget(55, [47, 55], "sample {n}")


# ---- the data: refused before the model loads ----------------------------------------------------------------

def test_a_sample_without_targets_is_named_before_the_model_loads(model_dir, tmp_path, capsys, no_frozen_model):
    data = _write_data(tmp_path / "unlabelled.jsonl", labelled=(True, False))
    assert main(_args(model_dir, data, tmp_path / "h.safetensors")) == 2
    assert refused_line(capsys) == (f"train-heads: error: sample 2 of {data} has no target tokens (all 56 labels are "
                                "-100); label the answer tokens with their ids, or leave the sample out")


def test_labels_of_another_length_or_on_the_first_token_are_named_before_the_model_loads(model_dir, tmp_path, capsys,
                                                                                         no_frozen_model):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3]}) + "\n")
    assert main(_args(model_dir, data, tmp_path / "h.safetensors")) == 2
    assert refused_line(capsys) == (f"train-heads: error: sample 1 of {data} has 4 input_ids but 3 labels; give both "
                                "lists the same length (labels -100 except on the target tokens)")
    data.write_text(json.dumps({"input_ids": [1, 2, 3, 4], "labels": [-100, 2, 3, 4]}) + "\n"
                    + json.dumps({"input_ids": [1, 2, 3, 4], "labels": [1, -100, -100, -100]}) + "\n")
    assert main(_args(model_dir, data, tmp_path / "h.safetensors")) == 2
    assert refused_line(capsys) == (f"train-heads: error: sample 2 of {data} labels its first token as a target; put a "
                                "prompt before the first target")


# ---- --resume: checked before the model loads ------------------------------------------------------------------

def test_resume_without_a_checkpoint_is_refused_before_the_model_loads(model_dir, data_file, tmp_path, capsys,
                                                                        no_frozen_model):
    out = tmp_path / "h.safetensors"
    assert main(_args(model_dir, data_file, out, "--resume")) == 2
    assert refused_line(capsys) == (f"train-heads: error: no checkpoint in {tmp_path / 'h.ckpt'}; train without --resume "
                                "first, or pass --resume PATH to a step-*.pt file")
    missing = tmp_path / "step-0000002.pt"
    assert main(_args(model_dir, data_file, out, "--resume", str(missing))) == 2
    assert refused_line(capsys) == (f"train-heads: error: {missing}: no such checkpoint; pass --resume with a step-*.pt "
                                "file or without a value")
    assert main(_args(model_dir, data_file, out, "--resume", "--overwrite")) == 2
    assert refused_line(capsys) == ("train-heads: error: --resume continues a run and --overwrite starts a new one over "
                                "it; pass one of them")
    assert not (tmp_path / "h.ckpt").exists()


def test_resume_from_another_run_is_refused_before_the_model_loads(model_dir, data_file, tmp_path, capsys,
                                                                   monkeypatch):
    out = tmp_path / "h.safetensors"
    assert main(_args(model_dir, data_file, out)) == 0  # a checkpoint at step 2
    before = _files(tmp_path)
    import rolecall.core.distributed

    monkeypatch.setattr(rolecall.core.distributed, "load_frozen_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(_args(model_dir, data_file, out, "--resume", "--lr", "0.02")) == 2
    assert refused_line(capsys) == (f"train-heads: error: checkpoint in {tmp_path / 'h.ckpt'} belongs to another run (lr "
                                "is 0.01 in the checkpoint but 0.02 now); use a new --output or --overwrite")
    damaged = tmp_path / "h.ckpt" / "step-0000001.pt"
    damaged.write_bytes(b"not a checkpoint")
    assert main(_args(model_dir, data_file, out, "--resume", str(damaged))) == 2
    assert refused_line(capsys) == (f"train-heads: error: {damaged}: not a readable checkpoint (UnpicklingError); delete "
                                "it and resume from an earlier one")
    damaged.unlink()
    assert _files(tmp_path) == before


# ---- --overwrite: the earlier run's files stay until this run has its own ---------------------------------------

def _nan_from_call(monkeypatch, first: int) -> None:
    """The distillation loss turns NaN from the ``first``-th call on (one call per sample, a step has one)."""
    from rolecall.train import recipe

    real, calls = recipe.distill_loss, []

    def loss(*a, **kw):
        calls.append(1)
        value, seen = real(*a, **kw)
        return (value * float("nan"), seen) if len(calls) >= first else (value, seen)

    monkeypatch.setattr(recipe, "distill_loss", loss)


NO_CHECKPOINT = ("the gates or the multiplier diverged; training stopped with no checkpoint to resume from (nothing "
                 "of this run was kept); lower --lr or --lambda-lr, or pass --mixed-precision no and rerun with "
                 "--overwrite")


def test_an_overwrite_that_fails_before_its_first_checkpoint_keeps_the_earlier_run(model_dir, data_file, tmp_path,
                                                                                   capsys, monkeypatch):
    out = tmp_path / "h.safetensors"
    assert main(_args(model_dir, data_file, out, "--steps", "6", "--no-plots")) == 0
    before = _files(tmp_path)
    assert {"h.safetensors", "h.config.json", "h.log.jsonl", "h.ckpt/log.jsonl", "h.ckpt/step-0000002.pt",
            "h.ckpt/step-0000004.pt"} <= set(before)
    _nan_from_call(monkeypatch, 1)
    assert main(_args(model_dir, data_file, out, "--overwrite", "--lr", "0.05")) == 2
    assert refused_line(capsys) == ("train-heads: error: step 0: distillation loss holds 1 non-finite value(s) of 1; "
                                + NO_CHECKPOINT)
    assert _files(tmp_path) == before  # every checkpoint, both logs, the manifest and its sidecar: byte for byte
    # a checkpoint of the earlier run still resumes
    monkeypatch.undo()
    assert main(_args(model_dir, data_file, out, "--steps", "6", "--resume")) == 0
    assert out.read_bytes() == before["h.safetensors"]


def test_a_fresh_run_that_fails_at_once_leaves_nothing_that_blocks_a_rerun(model_dir, data_file, tmp_path, capsys,
                                                                           monkeypatch):
    out = tmp_path / "run" / "h.safetensors"
    _nan_from_call(monkeypatch, 2)  # step 1, before the first checkpoint (step 2)
    assert main(_args(model_dir, data_file, out)) == 2
    assert refused_line(capsys) == ("train-heads: error: step 1: distillation loss holds 1 non-finite value(s) of 1; "
                                + NO_CHECKPOINT)
    assert list((tmp_path / "run").iterdir()) == []  # no empty h.ckpt/ (or log) left behind
    monkeypatch.undo()
    assert main(_args(model_dir, data_file, out)) == 0  # a plain rerun is not refused as "taken"


def test_a_run_that_fails_after_its_checkpoint_names_it(model_dir, data_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "h.safetensors"
    assert main(_args(model_dir, data_file, out)) == 0
    old = _files(tmp_path)
    _nan_from_call(monkeypatch, 4)  # step 3: after this run's checkpoint of step 2 replaced the earlier run's
    assert main(_args(model_dir, data_file, out, "--overwrite", "--lr", "0.05")) == 2
    assert refused_line(capsys) == (
        "train-heads: error: step 3: distillation loss holds 1 non-finite value(s) of 1; the gates or the multiplier "
        f"diverged; training stopped, its last checkpoint is {tmp_path / 'h.ckpt' / 'step-0000002.pt'} (--resume "
        "repeats the same settings, which are part of the run); lower --lr or --lambda-lr, or pass --mixed-precision "
        "no and rerun with --overwrite")
    now = _files(tmp_path)
    assert sorted(now) == sorted(old)  # no hidden folder left from the swap
    assert now["h.ckpt/step-0000002.pt"] != old["h.ckpt/step-0000002.pt"]  # this run's now
    assert [json.loads(x)["step"] for x in now["h.ckpt/log.jsonl"].decode().splitlines()] == [0, 1, 2]
    for name in ("h.safetensors", "h.config.json", "h.log.jsonl"):  # the manifest and its sidecars: the earlier run's
        assert now[name] == old[name]
    assert ckpt.load_checkpoint(tmp_path / "h.ckpt" / "step-0000002.pt")["config"]["lr"] == 0.05


def test_an_overwrite_without_checkpoints_replaces_the_earlier_ones_with_its_manifest(model_dir, data_file, tmp_path):
    out = tmp_path / "h.safetensors"
    assert main(_args(model_dir, data_file, out)) == 0
    assert (tmp_path / "h.ckpt" / "step-0000002.pt").is_file()
    assert main(_args(model_dir, data_file, out, "--overwrite", "--steps", "2", "--checkpoint-every", "5")) == 0
    assert not (tmp_path / "h.ckpt").exists()  # the earlier run's: gone with its manifest
    assert RoleManifest.load(out).metrics["steps"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "h.config.json", "h.log.jsonl",
                                                          "h.safetensors"]


def test_a_folder_that_cannot_be_filled_leaves_the_earlier_checkpoints_alone(tmp_path):
    out = tmp_path / "h.safetensors"
    folder = ckpt.checkpoint_dir(out)
    folder.mkdir()
    (folder / "step-0000002.pt").write_bytes(b"earlier")

    def fill(new):
        (new / "step-0000002.pt").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.replace_folder(out, fill)
    assert _files(tmp_path) == {"h.ckpt/step-0000002.pt": b"earlier"}
    assert ckpt.replace_folder(out, lambda new: (new / "step-0000004.pt").write_bytes(b"new")) == folder
    assert _files(tmp_path) == {"h.ckpt/step-0000004.pt": b"new"}


# ---- the manifest is published last ----------------------------------------------------------------------------

def test_the_sidecars_are_in_place_before_the_manifest(model_dir, data_file, tmp_path, monkeypatch, capsys):
    """When the manifest's rename happens, the config and log beside it are already the new run's: a kill at any
    point never pairs a new manifest with an earlier run's sidecars. A failure right there keeps the earlier
    manifest."""
    out = tmp_path / "h.safetensors"
    assert main(_args(model_dir, data_file, out, "--steps", "2", "--checkpoint-every", "5")) == 0
    old = out.read_bytes()
    seen = {}

    def save(manifest, path):
        seen["config"] = json.loads((tmp_path / "h.config.json").read_text())
        seen["log"] = (tmp_path / "h.log.jsonl").read_text().splitlines()
        raise OSError("killed")

    monkeypatch.setattr(RoleManifest, "save", save)
    assert main(_args(model_dir, data_file, out, "--overwrite", "--steps", "3", "--checkpoint-every", "5")) == 2
    assert refused_line(capsys) == "train-heads: error: killed"
    assert seen["config"]["steps"] == 3 and len(seen["log"]) == 3
    assert out.read_bytes() == old
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no hidden plot folder left


def test_a_nan_model_is_named_as_the_cause(tmp_path):
    """Non-finite teacher logits: the model, not the rates, and no checkpoint: nothing is written."""
    from rolecall import train
    from rolecall.train.config import TrainConfig
    from rolecall.train.distill import NotFiniteError

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    ids = torch.arange(40)
    labels = torch.full_like(ids, -100)
    labels[-4:] = ids[-4:]
    cfg = TrainConfig(model="tiny", target=1, steps=3, prefill_chunk=16, plots=False,
                      output=str(tmp_path / "h.safetensors"))
    with pytest.raises(NotFiniteError) as stop:
        train.run(model, tiny_tokenizer(), [{"input_ids": ids, "labels": labels}], cfg)
    assert str(stop.value) == (
        f"step 0: teacher logits holds 4 non-finite value(s) of {4 * model.config.vocab_size}; the model's own logits "
        "are not finite before any gate acts, so its weights or --dtype are the cause, not the rates; training "
        "stopped with no checkpoint to resume from (nothing of this run was kept); fix the model or pass another "
        "--dtype and rerun with --overwrite")
    assert list(tmp_path.iterdir()) == []
