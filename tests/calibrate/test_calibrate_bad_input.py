"""``calibrate-delta`` on input it cannot use (issue #59): one line naming the flag, the value and the fix, before the
model loads, and a manifest published after its sidecars so that nothing earlier is lost. A 4-layer tiny model folder,
as in test_calibrate_cli.py."""

from __future__ import annotations

import json

import pytest

from rolecall.calibrate import cli
from rolecall.core.manifest import RoleManifest
from tests import refused_line, usage_error
from tests.tiny import tiny_folder, tiny_tokenizer

FLAGS = ["--max-new-tokens", "48", "--stride", "6", "--min-context", "40", "--page-size", "4", "--num-pages", "3",
         "--recent-pages", "2", "--warmup", "1", "--num-delta", "2", "--min-gap", "1", "--bins", "3", "--device", "cpu",
         "--quiet"]
HELP = "(`calibrate-delta --help` lists the options)"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", layers=4, heads=4, kv_heads=2, seed=7)


@pytest.fixture
def traces(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"ids": [(7 * i + k) % 256 for i in range(n)]}) + "\n"
                            for k, n in ((1, 64), (2, 80))))
    return path


@pytest.mark.parametrize("flag, value, within, example", [
    ("--temperature", "inf", "(0, ∞)", "0.6"),
    ("--temperature", "nan", "(0, ∞)", "0.6"),
    ("--top-p", "2", "(0, 1]", "0.95"),
    ("--target-recall", "nan", "(0, 1]", "0.9"),
    ("--budget", "inf", "(0, 1]", "0.25"),
    ("--min-budget", "-1", "[0, 1]", "0.02"),
])
def test_a_float_flag_out_of_range_is_a_usage_error(model_dir, capsys, no_frozen_model, flag, value, within, example):
    """The refusal names the flag, the value, the range it must lie in and a value to pass."""
    says = f"'{value}' is not a finite number in {within}; pass e.g. {example}"
    assert usage_error(capsys, cli.main, ["--model", str(model_dir), *FLAGS, "--sample", flag, value]) == (
        f"calibrate-delta: error: argument {flag}: {says} {HELP}")


def test_an_infinite_temperature_in_the_yaml_isrefused_line(model_dir, tmp_path, capsys, no_frozen_model):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("temperature: .inf\nsample: true\n")
    assert cli.main(["--model", str(model_dir), *FLAGS, "--config", str(yaml_file)]) == 2
    assert refused_line(capsys) == ("calibrate-delta: error: calibration config: temperature must be a finite number > 0 "
                                "and top_p in (0, 1], got inf and 0.95")


@pytest.mark.parametrize("source,says", [
    ("bogus", "--prompts: unknown reasoning source 'bogus'; choose champ, arithmetic[:N] or jsonl:PATH"),
    ("arithmetic:0", "--prompts: arithmetic:0: ask for at least one problem"),
])
def test_a_bad_prompt_source_is_refused_before_the_model_loads(model_dir, capsys, no_frozen_model, monkeypatch, source, says):
    import rolecall.core.models

    monkeypatch.setattr(rolecall.core.models, "load_config", lambda *a, **k: pytest.fail("config read"))
    assert cli.main(["--model", str(model_dir), *FLAGS, "--prompts", source]) == 2
    assert refused_line(capsys) == f"calibrate-delta: error: {says}"


def test_a_min_context_past_every_trace_is_refused_before_the_model_loads(model_dir, traces, capsys, no_frozen_model):
    assert cli.main(["--model", str(model_dir), *FLAGS, "--traces", str(traces), "--min-context", "80"]) == 2
    assert refused_line(capsys) == (
        f"calibrate-delta: error: --min-context 80 records nothing: the longest trace of {traces} (trace 2) has 80 "
        "tokens, and recording starts at position 80; pass --min-context below 80, or longer traces")
    # --max-traces 1 keeps the 64-token trace alone
    assert cli.main(["--model", str(model_dir), *FLAGS, "--traces", str(traces), "--min-context", "64",
                     "--max-traces", "1"]) == 2
    assert "--min-context 64 records nothing: the longest trace of" in refused_line(capsys)


def test_a_min_context_past_every_generated_trace_is_refused_before_the_model_loads(model_dir, capsys, no_frozen_model):
    from rolecall.data.reasoning import format_prompt, load_prompts

    tok = tiny_tokenizer()
    longest = max(len(tok(format_prompt(tok, p), add_special_tokens=False)["input_ids"])
                  for p in load_prompts("arithmetic:3", 8))
    most = longest + 48
    assert cli.main(["--model", str(model_dir), *FLAGS, "--prompts", "arithmetic:3", "--min-context", str(most)]) == 2
    assert refused_line(capsys) == (
        f"calibrate-delta: error: --min-context {most} records nothing: the traces of --prompts arithmetic:3 (the "
        f"longest prompt, {longest} tokens, and --max-new-tokens 48) have at most {most} tokens, and recording starts "
        f"at position {most}; pass --min-context below {most}, or a larger --max-new-tokens")


def test_the_config_and_plots_are_in_place_before_the_manifest(model_dir, traces, tmp_path, monkeypatch, capsys):
    """When the manifest's rename happens its sidecars are already the new run's, so a kill never pairs a new
    manifest with an earlier config; a failure right there leaves the earlier manifest."""
    out = tmp_path / "out" / "m.safetensors"
    argv = ["--model", str(model_dir), *FLAGS, "--traces", str(traces), "--output", str(out)]
    assert cli.main([*argv, "--no-plots"]) == 0
    old = out.read_bytes()
    seen = {}

    def save(manifest, path):
        seen["config"] = json.loads((out.parent / "m.config.json").read_text())
        seen["plots"] = sorted(p.name for p in out.parent.glob("*.png"))
        raise OSError("killed")

    monkeypatch.setattr(RoleManifest, "save", save)
    assert cli.main([*argv, "--bins", "2"]) == 2
    assert refused_line(capsys) == "calibrate-delta: error: killed"
    assert seen == {"config": {**seen["config"], "bins": 2},
                    "plots": ["m.recall.png", "m.shift.png", "m.sparsity.png"]}
    assert out.read_bytes() == old and RoleManifest.load(out).config["bins"] == 3
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]  # no hidden plot folder left
