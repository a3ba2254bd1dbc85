"""The real CLI end to end on a tiny model folder, shipped configs, determinism and errors."""

from __future__ import annotations

import importlib.resources
import json
import re

import pytest
import torch

from rolecall import calibrate
from rolecall.calibrate import cli
from rolecall.calibrate.config import ConfigError, read_yaml, resolve
from rolecall.calibrate.traces import read_traces
from rolecall.core.manifest import RoleManifest
from tests.tiny import tiny_folder, tiny_model, tiny_tokenizer

FLAGS = ["--prompts", "arithmetic:3", "--max-new-tokens", "48", "--stride", "6", "--min-context", "40",
         "--page-size", "4", "--num-pages", "3", "--recent-pages", "2", "--warmup", "1", "--num-delta", "2",
         "--min-gap", "1", "--bins", "3", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", layers=4, heads=4, kv_heads=2, seed=7)


def test_cli_writes_a_deterministic_manifest_plots_and_config(model_dir, tmp_path, cache_dir, capsys):
    out1, out2 = tmp_path / "a" / "m.delta.safetensors", tmp_path / "b" / "m.delta.safetensors"
    assert cli.main(["--model", str(model_dir), "--output", str(out1), *FLAGS]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]  # the run's wall time, split by phase, in order
    phases = re.fullmatch(r"calibrate-delta: wall time ([\d.]+) s: load ([\d.]+) s, generation ([\d.]+) s, "
                          r"recording ([\d.]+) s, selection ([\d.]+) s, writing ([\d.]+) s, other ([\d.]+) s", last)
    assert phases, last
    total, *parts = map(float, phases.groups())
    assert sum(parts) == pytest.approx(total, abs=0.35)  # each rounded to 0.1 s
    cached = list((cache_dir / "traces").glob("*.jsonl"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    assert cli.main(["--model", str(model_dir), "--output", str(out2), *FLAGS]) == 0
    assert cached[0].stat().st_mtime_ns == stamp  # the second run read the cached traces
    assert out1.read_bytes() == out2.read_bytes()
    m = RoleManifest.load(out1)
    m.validate_for(tiny_model("qwen2", layers=4, heads=4, kv_heads=2).config)
    assert m.layer_role.tolist()[:2] == [0, 1] and m.delta_layers[0] == 1 and len(m.delta_layers) == 2
    assert m.layer_sparsity.shape == (4, 3) and m.layer_budget.mean().item() == pytest.approx(0.25, rel=1e-4)
    assert m.data["traces"] == 3 and m.data["source"] == "generated:arithmetic:3" and len(m.data["sha256"]) == 64
    assert m.data["sha256"] == calibrate.traces.traces_sha256(read_traces(cached[0]))
    assert 0.0 < m.metrics["recall_mean"] <= 1.0 and m.metrics["sampled_queries"] > 10
    assert m.config["num_pages"] == 3 and m.config["model"] == model_dir.name  # a local folder by its name
    saved = json.loads((out1.parent / "m.delta.config.json").read_text())
    assert saved == {**m.config, "model": str(model_dir), "output": str(out1)}  # the sidecar keeps the paths as given
    for kind in ("shift", "sparsity", "recall"):
        assert (out1.parent / f"m.delta.{kind}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_api_takes_texts_and_matches_the_pair_matrix(model_dir):
    model, tok = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, seed=7), tiny_tokenizer()
    texts = ["The quick brown fox jumps over the lazy dog. " * 3, "Pack my box with five dozen liquor jugs. " * 3]
    config = {"stride": 5, "min_context": 30, "page_size": 4, "num_pages": 2, "recent_pages": 1, "warmup": 1,
              "num_delta": 2, "min_gap": 1, "select": "recall"}
    m = calibrate.run(model, tok, texts, config, progress=False)
    pairs = torch.tensor(m.metrics["recall_pairs"])
    from rolecall.calibrate.delta import mean_sparse_recall

    assert m.metrics["recall_mean"] == pytest.approx(mean_sparse_recall(pairs, m.delta_layers, 1), abs=1e-5)
    # the greedy recall search is at least as good as the peaks it is compared with
    assert m.metrics["recall_mean"] >= m.metrics["peaks_recall_mean"] - 1e-6
    assert m.model.config_sha256 and m.data["tokens"] == sum(len(tok(t)["input_ids"]) for t in texts)


def test_every_shipped_calibration_config_resolves():
    folder = importlib.resources.files("rolecall.configs") / "calibrate"
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".yaml"))
    assert "smollm2-135m.yaml" in names and "qwen-14b.yaml" in names
    for name in names:
        config = resolve(read_yaml(str(folder / name)))
        assert config.model == name.removesuffix(".yaml")


def test_flags_override_yaml_override_defaults(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("stride: 4\nnum_pages: 9\n")
    args = cli.build_parser().parse_args(["--config", str(yaml_file), "--stride", "2"])
    config, _ = cli.resolve_config(args)
    assert (config.stride, config.num_pages, config.recent_pages) == (2, 9, 8)


@pytest.mark.parametrize("argv,message", [
    (["--traces", "/nonexistent/t.jsonl"], "no such file"),
    (["--stride", "0"], "stride must be an integer ≥ 1"),
    (["--select", "best"], "select must be one of"),
    (["--config", "/nonexistent.yaml"], "no such file"),
])
def test_bad_input_is_one_line(model_dir, argv, message, capsys):
    assert cli.main(["--model", str(model_dir), "--quiet", "--num-delta", "2", *argv]) == 2  # 4 layers: 2 fit
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("calibrate-delta: error: ") and message in last


def test_unknown_yaml_key_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="unknown option 'strid'"):
        resolve({"strid": 3})


def test_traces_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"ids": [1, 2]}\n{"ids": []}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        read_traces(bad)


def test_the_key_older_manifests_call_k_still_reads_and_the_flag_is_gone(tmp_path, capsys):
    """``top_pages`` is what the shipped manifests written before the rename call K in their settings: a config
    with it reads as ``num_pages``; the flag ``--top-pages`` never shipped in a release and is refused."""
    from rolecall.calibrate.cli import build_parser, resolve_config

    args = build_parser().parse_args(["--config", str(_yaml(tmp_path, "top_pages: 9\nrecent_pages: 2\n"))])
    assert resolve_config(args)[0].num_pages == 9
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--top-pages", "12"])
    assert "unrecognized arguments: --top-pages 12" in capsys.readouterr().err


def _yaml(folder, text):
    path = folder / "old.yaml"
    path.write_text(text)
    return path


# ---- refused before the model loads ---------------------------------------------------------------------------

def _refused(capsys) -> str:
    """The one line a refused run printed last (no traceback)."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1]


@pytest.fixture
def no_model(monkeypatch):
    import rolecall.core.distributed

    monkeypatch.setattr(rolecall.core.distributed, "load_frozen_model", lambda *a, **k: pytest.fail("model loaded"))


def test_a_device_this_machine_lacks_is_refused_before_the_model_loads(model_dir, capsys, no_model):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert cli.main(["--model", str(model_dir), *FLAGS, "--device", f"cuda:{gpus}"]) == 2
    assert _refused(capsys).startswith(f"calibrate-delta: error: --device cuda:{gpus}: this machine has ")


def test_an_unknown_dtype_is_refused_as_a_usage_error(model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--model", str(model_dir), *FLAGS, "--dtype", "bogus"])
    assert stop.value.code == 2
    line = _refused(capsys)
    assert "argument --dtype: invalid choice: 'bogus' (choose from 'bfloat16', 'float16', 'float32')" in line
    assert cli.main(["--model", str(model_dir), *FLAGS, "--config", str(_yaml(tmp_path, "dtype: bogus\n"))]) == 2
    assert "dtype must be one of bfloat16, float16, float32, got 'bogus'" in _refused(capsys)


@pytest.mark.parametrize("flags,says", [
    (["--num-delta", "4"], "--num-delta 4 is more than the 3 layers to select from (4 layers less 1 warm-up); "
                           "pass --num-delta N with 1 <= N <= 3, or --num-delta auto"),
    (["--warmup", "4"], "--warmup 4 leaves no layer to select Δ-layers from in a 4-layer model; pass --warmup W "
                        "with 0 <= W <= 3"),
])
def test_layer_counts_are_checked_against_the_models_config_before_it_loads(model_dir, capsys, no_model, flags, says):
    assert cli.main(["--model", str(model_dir), *FLAGS, *flags]) == 2
    assert _refused(capsys) == f"calibrate-delta: error: {says}"


def test_zero3_outside_a_launcher_is_refused_before_the_model_loads(model_dir, tmp_path, capsys, no_model,
                                                                     monkeypatch):
    from rolecall.core.distributed import LAUNCHER_ENVIRONMENT

    for name in LAUNCHER_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    traces = tmp_path / "t.jsonl"
    traces.write_text(json.dumps({"ids": list(range(60))}) + "\n")
    assert cli.main(["--model", str(model_dir), *FLAGS, "--traces", str(traces), "--deepspeed", "zero3"]) == 2
    line = _refused(capsys)
    assert line.startswith("calibrate-delta: error: --deepspeed zero3: ZeRO-3 shards the model over the processes a "
                           "launcher starts") and "`torchrun`" in line and "accelerate launch" in line


def test_device_map_without_a_gpu_warns_in_one_line(model_dir, capsys, no_model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--model", str(model_dir), *FLAGS, "--device-map", "auto", "--num-delta", "9"]) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert warning == ("calibrate-delta: warning: --device-map auto spreads a model over GPUs and this machine has "
                       "none; on the CPU it only slows the run down, so leave --device-map out")
    assert error.startswith("calibrate-delta: error: --num-delta 9")


@pytest.mark.parametrize("target,warned", [("1.0", True), ("0.01", False)])
def test_auto_keeping_most_layers_full_is_said(model_dir, tmp_path, cache_dir, capsys, target, warned):
    out = tmp_path / "m.delta.safetensors"
    argv = ["--model", str(model_dir), "--output", str(out), *FLAGS, "--no-plots", "--select", "recall",
            "--num-delta", "auto", "--target-recall", target]
    assert cli.main(argv) == 0
    chosen = len(RoleManifest.load(out).delta_layers)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    if warned:
        assert warnings == [f"calibrate-delta: warning: --num-delta auto chose {chosen} of the 3 selectable layers as "
                            f"Δ-layers to reach --target-recall {float(target)}; Δ-layers run full attention, so "
                            "little of the model stays sparse; pass a lower --target-recall or a fixed --num-delta"]
    else:
        assert chosen == 1 and warnings == []
