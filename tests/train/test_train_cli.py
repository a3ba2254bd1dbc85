"""The real ``train-heads`` command line, a few steps on a 2-layer tiny model saved to a folder."""

import json
import re

import pytest
import torch

from rolecall.cli import main as rolecall_main
from rolecall.core.manifest import RoleManifest
from rolecall.train.cli import main
from tests import refused_line
from tests.tiny import tiny_folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("tiny-model"), "llama", layers=2, heads=4, kv_heads=2)


@pytest.fixture
def data_file(tmp_path):
    g = torch.Generator().manual_seed(5)
    lines = []
    for n in (48, 56):
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        labels = [-100] * (n - 6) + ids[n - 6 :]
        lines.append(json.dumps({"input_ids": ids, "labels": labels}))
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _args(model_dir, data_file, out, *extra):
    return ["--model", str(model_dir), "--dataset", str(data_file), "--output", str(out), "--target", "1",
            "--steps", "4", "--checkpoint-every", "2", "--prefill-chunk", "16", "--device", "cpu", "--no-plots",
            "--lambda-lr", "0.1", *extra]


def test_cli_trains_resumes_exactly_and_inspect_reads_it(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "run" / "heads.safetensors"
    assert main(_args(model_dir, data_file, out)) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert out.is_file() and printed[0].startswith(f"wrote {out}: ")
    assert re.fullmatch(r"train-heads: wall time [\d.]+ s: load [\d.]+ s, data [\d.]+ s, training \(checkpoints "
                        r"and the manifest written\) [\d.]+ s, other [\d.]+ s", printed[-1]), printed[-1]
    first = out.read_bytes()
    m = RoleManifest.load(out)
    assert m.head_role.shape == (2, 2) and m.config["steps"] == 4 and m.data["kind"] == "jsonl"
    assert m.config["lambda_lr"] == 0.1 and m.metrics["steps"] == 4
    # --resume without a value picks the newest checkpoint (step 2) and reproduces the manifest byte for byte
    out.unlink()
    assert main(_args(model_dir, data_file, out, "--resume")) == 0
    assert out.read_bytes() == first
    assert rolecall_main(["inspect", str(out)]) == 0
    assert "R" in capsys.readouterr().out


def test_cli_errors_are_one_line(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "heads.safetensors"
    assert main(_args(model_dir, tmp_path / "missing.jsonl", out)) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("train-heads: error:") and "missing.jsonl" in last and "--dataset" in last
    assert main(_args(model_dir, data_file, out, "--gate", "kuma")) == 2
    assert "gate 'kuma' is unknown" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(_args(model_dir, data_file, out, "--token-budget", "lots"))


@pytest.mark.slow
def test_embedded_model_student_equals_teacher_and_trains(tmp_path):
    """SmolLM2-135M (GQA 9/3): all-retrieval gates reproduce the teacher; two steps write a valid manifest."""
    from rolecall import train
    from rolecall.core.models import load_model, load_tokenizer
    from rolecall.train.config import TrainConfig
    from rolecall.train.distill import distill_loss
    from rolecall.train.hybrid import HybridAttention

    tok, model = load_tokenizer("smollm2-135m"), load_model("smollm2-135m").requires_grad_(False)
    text = "The passkey is lima oscar kilo. " + "The grass is green and the sky is blue. " * 20
    prompt = tok(text + "What is the passkey? The passkey is", return_tensors="pt").input_ids[0]
    answer = tok(" lima oscar kilo.", return_tensors="pt").input_ids[0]
    ids = torch.cat([prompt, answer])
    labels = torch.full_like(ids, -100)
    labels[len(prompt) :] = answer
    z = torch.ones(29, 3)
    loss, seen = distill_loss(model, HybridAttention(30, 0.3), z, ids, labels, prefill_chunk=64)
    torch.testing.assert_close(seen["student logits"], seen["teacher logits"], atol=2e-3, rtol=1e-4)
    sparse, _ = distill_loss(model, HybridAttention(30, 0.05), torch.zeros(29, 3), ids, labels, prefill_chunk=64)
    assert float(sparse) > 100 * max(float(loss), 1e-6)
    cfg = TrainConfig(target=8, steps=2, prefill_chunk=64, output=str(tmp_path / "h.safetensors"), plots=False)
    m = train.run(model, tok, [{"input_ids": ids, "labels": labels}], cfg)
    RoleManifest.load(tmp_path / "h.safetensors").validate_for(model)
    assert m.head_role.shape == (30, 3) and m.model.name == "smollm2-135m"


def test_summary_says_how_far_from_converged():
    from rolecall.train.cli import convergence

    settled = {"steps": 3000, "fraction_undecided": 0.02, "expected_l0": 8.3, "expected_l0_goal": 8.0}
    assert convergence(settled) is None
    demo = {"steps": 20, "fraction_undecided": 0.9, "expected_l0": 29.0, "expected_l0_goal": 8.0}
    line = convergence(demo)
    assert line.startswith("not converged after 20 steps: 90 % of the gates are undecided") and "21.0 heads" in line
    assert "artifacts/smollm2-135m/heads-" in line and "\n" not in line
    assert convergence({**settled, "expected_l0": 10.0}) is not None  # decided gates, but off the target


def test_the_progress_bar_ends_on_the_summarys_expected_l0(model_dir, data_file, tmp_path, capsys):
    """The bar shows E[L0] of the gates after each step, so its last value is the one the summary reports (the log
    keeps the value each step's λ update used, from before the step)."""
    import re

    out = tmp_path / "heads.safetensors"
    assert main(_args(model_dir, data_file, out)) == 0
    captured = capsys.readouterr()
    shown = re.findall(r"EL0=([0-9.]+)", captured.err)
    summary = re.search(r"E\[L0\] ([0-9.]+) \(goal", captured.out).group(1)
    assert shown and shown[-1] == summary == f"{RoleManifest.load(out).metrics['expected_l0']:.2f}"
    last = json.loads(out.with_name("heads.log.jsonl").read_text().splitlines()[-1])
    assert f"{last['expected_l0']:.2f}" != summary  # the last step moved it


# ---- refused before the model loads ---------------------------------------------------------------------------

def test_a_device_this_machine_lacks_is_refused_before_the_model_loads(model_dir, data_file, tmp_path, capsys,
                                                                       no_frozen_model):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert main([*_args(model_dir, data_file, tmp_path / "h.safetensors"), "--device", f"cuda:{gpus}"]) == 2
    assert refused_line(capsys).startswith(f"train-heads: error: --device cuda:{gpus}: this machine has ")


def test_an_unknown_dtype_is_refused_as_a_usage_error(model_dir, data_file, tmp_path, capsys, no_frozen_model):
    with pytest.raises(SystemExit) as stop:
        main(_args(model_dir, data_file, tmp_path / "h.safetensors", "--dtype", "bogus"))
    assert stop.value.code == 2
    assert "argument --dtype: invalid choice: 'bogus' (choose from 'bfloat16', 'float16', 'float32')" in refused_line(capsys)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("dtype: bogus\n")
    assert main(_args(model_dir, data_file, tmp_path / "h.safetensors", "--config", str(yaml_file))) == 2
    assert "dtype must be one of bfloat16, float16, float32, got 'bogus'" in refused_line(capsys)


def test_zero3_outside_a_launcher_is_refused_before_the_model_loads(model_dir, data_file, tmp_path, capsys, no_frozen_model,
                                                                    monkeypatch):
    from rolecall.core.distributed import LAUNCHER_ENVIRONMENT

    for name in LAUNCHER_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    assert main(_args(model_dir, data_file, tmp_path / "h.safetensors", "--deepspeed", "zero3")) == 2
    line = refused_line(capsys)
    assert line.startswith("train-heads: error: --deepspeed zero3: ZeRO-3 shards the model over the processes a "
                           "launcher starts") and "`torchrun`" in line and "accelerate launch" in line


def test_device_map_without_a_gpu_warns_in_one_line(model_dir, data_file, tmp_path, capsys, no_frozen_model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(_args(model_dir, data_file, tmp_path / "h.safetensors", "--device-map", "auto", "--target", "9")) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert warning == ("train-heads: warning: --device-map auto spreads a model over GPUs and this machine has none; "
                       "on the CPU it only slows the run down, so leave --device-map out")
    assert error.startswith("train-heads: error: target 9 is more than the 2 gated heads")


def test_a_resume_keeps_no_log_record_of_a_step_past_its_checkpoint(model_dir, data_file, tmp_path, capsys):
    """A run killed between writing its progress log and its next checkpoint leaves the log ahead: the log saved
    with the step-2 checkpoint also holds step 2. A resume from step 2 runs step 2 again and logs it once."""
    from rolecall.train import checkpoint as ckpt

    out = tmp_path / "run" / "heads.safetensors"
    assert main(_args(model_dir, data_file, out)) == 0
    log = out.parent / "heads.log.jsonl"
    step2 = next(line for line in log.read_text().splitlines() if json.loads(line)["step"] == 2)
    saved = ckpt.progress_log(ckpt.checkpoint_path(out, 2).parent)
    assert saved.is_file()
    saved.write_text(saved.read_text() + step2 + "\n")  # the log ran ahead of its checkpoint
    out.unlink()
    log.unlink()
    assert main(_args(model_dir, data_file, out, "--resume", str(ckpt.checkpoint_path(out, 2)))) == 0
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2, 3]
