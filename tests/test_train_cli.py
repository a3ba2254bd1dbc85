"""The real ``train-heads`` command line, a few steps on a 2-layer tiny model saved to a folder."""

import json

import pytest
import torch

from runtime.cli import main as rolecall_main
from runtime.manifest import RoleManifest
from tests.tiny import tiny_model, tiny_tokenizer
from train.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_model("llama", layers=2, heads=4, kv_heads=2).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


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
    assert "1 retrieval heads" in capsys.readouterr().out or out.is_file()
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
