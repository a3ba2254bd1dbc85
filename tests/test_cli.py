import json
from pathlib import Path

import pytest
import torch

from rolecall.cli import main
from rolecall.core.manifest import ModelIdentity, RoleManifest
from tests.tiny import tiny_config, tiny_model, tiny_tokenizer


@pytest.fixture
def manifest_path(tmp_path):
    config = tiny_config("qwen2", layers=4, heads=4, kv_heads=2)
    m = RoleManifest(ModelIdentity.from_config(config, name="tiny-qwen2"), layer_role=[0, 1, 2, 2],
                     layer_shift=[0.0, 0.3, 0.1, 0.05], layer_sparsity=torch.rand(4, 6),
                     head_role=torch.tensor([[1, 1], [0, 1], [1, 0], [0, 0]], dtype=torch.int8),
                     head_expected_gate=torch.tensor([[0.9, 0.8], [0.1, 0.7], [0.6, 0.2], [0.0, 0.3]]),
                     metrics={"recall": 0.875})
    return m.save(tmp_path / "m.safetensors")


def test_inspect_prints_identity_and_roles(manifest_path, capsys):
    assert main(["inspect", str(manifest_path)]) == 0
    out = capsys.readouterr().out
    assert "tiny-qwen2" in out and "4 layers, 4 query heads, 2 KV heads, head dim 16" in out
    assert "Δ-layers     [1]" in out and "retrieval    2 of 6 KV heads past layer 0, 4 of 8 with layer 0's 2" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[1] for r in rows] == ["F", "Δ", "·", "·"]
    assert [r[-1] for r in rows] == ["RR", "·R", "R·", "··"]


def test_inspect_verify_and_plot(manifest_path, tmp_path, capsys):
    assert main(["inspect", str(manifest_path), "--verify", "--plot", str(tmp_path / "p.png")]) == 0
    assert "content hash" in capsys.readouterr().out
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_inspect_reports_corruption_and_mismatch(manifest_path, tmp_path, capsys):
    raw = bytearray(manifest_path.read_bytes())
    raw[-3] ^= 0x10
    (tmp_path / "bad.safetensors").write_bytes(bytes(raw))
    assert main(["inspect", str(tmp_path / "bad.safetensors"), "--verify"]) == 1  # as --help says
    assert "corrupted" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "bad.safetensors")]) == 2  # not verifying: an error like any other
    capsys.readouterr()

    folder = tmp_path / "model6"
    tiny_model("qwen2", layers=6, heads=4, kv_heads=2).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    assert main(["inspect", str(manifest_path), "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "model.num_layers is 4 in the manifest" in err and "but 6 in the model" in err


def _without_keys(raw: bytes, keys: tuple[str, ...]) -> bytes:
    """A safetensors file with ``keys`` removed from its metadata (what an editing tool might leave)."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    for key in keys:
        header["__metadata__"].pop(key)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]


def test_verify_needs_a_checked_content_hash(manifest_path, tmp_path, capsys):
    """An edited manifest whose hash and version keys were removed is described (with a note that it was not
    verified), but --verify checked nothing: exit 1. It loads only with strict=False; saved, it has a hash."""
    from rolecall.core.manifest import UnverifiedManifestWarning

    edited = tmp_path / "edited.safetensors"
    raw = manifest_path.read_bytes()
    edited.write_bytes(_without_keys(raw, ("content_sha256", "rolecall_version")))
    assert main(["inspect", str(edited)]) == 0  # it still loads and describes itself
    assert capsys.readouterr().err.startswith(f"rolecall inspect: note: {edited}: no content hash")
    assert main(["inspect", str(edited), "--verify"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("not verified: the file has no content hash") and "\n" not in err
    with pytest.warns(UnverifiedManifestWarning):
        RoleManifest.load(edited, strict=False).save(tmp_path / "resaved.safetensors")
    assert main(["inspect", str(tmp_path / "resaved.safetensors"), "--verify"]) == 0


def test_unknown_policy_parameter_is_one_plain_line(capsys):
    from rolecall.runtime.policies import PolicyError, get_policy

    with pytest.raises(PolicyError) as info:
        get_policy("delta", bogus=3)
    message = str(info.value)
    assert message == ("policy 'delta' has no parameter 'bogus'; its parameters are: num_pages, recent_pages, "
                       "page_size, budget, per_head, refine")
    assert "__init__" not in message and "keyword argument" not in message


def test_running_out_of_gpu_memory_is_one_line_naming_the_fixes(capsys, tmp_path):
    from rolecall.cli import run_reporting_errors

    kept = tmp_path / "cells.partial.jsonl"

    def grid(_):
        kept.write_text("{}\n")  # a finished batch, written before the failing one
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 502.00 MiB")

    assert run_reporting_errors("benchmarks/quality.py", grid, None) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("benchmarks/quality.py: error: out of GPU memory")
    assert "--batch-size" in err and "Traceback" not in err and kept.read_text() == "{}\n"
    with pytest.raises(RuntimeError, match="another failure"):  # other errors keep their traceback
        run_reporting_errors("x", lambda _: (_ for _ in ()).throw(RuntimeError("another failure")), None)


@pytest.mark.parametrize("parse,argv,prog,says", [
    ("rolecall", ["decode", "--max-new-tokens", "many"], "rolecall decode", "argument --max-new-tokens: invalid int value: 'many'"),
    ("rolecall", ["decode", "--prompts", "p.jsonl", "--prompt", "hi"], "rolecall decode",
     "argument --prompt: not allowed with argument --prompts"),
    ("rolecall", ["evaluate"], "rolecall", "argument COMMAND: invalid choice: 'evaluate'"),
    ("calibrate", ["--bogus"], "calibrate-delta", "unrecognized arguments: --bogus"),
    ("train", ["--target"], "train-heads", "argument --target: expected one argument"),
    ("decode-benchmark", ["--models", "9b"], None, "--models: unknown 9b; known: 7b, 1.5b"),  # prog: the script's
])
def test_a_usage_error_is_one_line(capsys, parse, argv, prog, says):
    """A bad argument is refused in one line (argparse's own message, then where the options are listed), with
    no usage block before it, in every command and benchmark script."""
    from benchmarks import decode as bench
    from rolecall.calibrate.cli import build_parser as calibrate_parser
    from rolecall.train.cli import main as train_main

    run = {"rolecall": main, "calibrate": lambda a: calibrate_parser().parse_args(a), "train": train_main,
           "decode-benchmark": bench.parse_args}[parse]
    with pytest.raises(SystemExit) as done:
        run(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "usage:" not in err
    prog = prog or err.split(":")[0]
    assert err.startswith(f"{prog}: error: ") and says in err and err.endswith(f"(`{prog} --help` lists the options)\n")


@pytest.mark.parametrize("argv", [["--help"], ["calibrate", "--help"], ["decode", "--help"], ["eval", "--help"],
                                  ["train", "--help"], ["inspect", "--help"], ["merge", "--help"],
                                  ["serve", "--help"]])
def test_help_loads_no_model_library(argv):
    """Help is read before anything runs: it imports neither transformers nor torch (seconds on a cold start)."""
    import subprocess
    import sys

    code = ("import sys\nfrom rolecall.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert "usage: rolecall" in done.stdout and done.stderr.strip().splitlines()[-1] == "[]"


def test_export_import_merge_commands(manifest_path, tmp_path):
    folder = tmp_path / "model4"
    tiny_model("qwen2", layers=4, heads=4, kv_heads=2).save_pretrained(folder)
    assert main(["export", str(manifest_path), "--format", "duo", "-o", str(tmp_path / "duo")]) == 0
    assert main(["import", str(tmp_path / "duo"), "--format", "duo", "--model", str(folder),
                 "-o", str(tmp_path / "heads.safetensors")]) == 0
    heads = RoleManifest.load(tmp_path / "heads.safetensors")
    assert heads.sections == ["heads"]
    assert torch.equal(heads.head_role, RoleManifest.load(manifest_path).head_role)
    assert main(["export", str(manifest_path), "--format", "layers", "-o", str(tmp_path / "l.json")]) == 0
    assert main(["import", str(tmp_path / "l.json"), "--format", "layers", "--model", str(folder),
                 "-o", str(tmp_path / "layers.safetensors")]) == 0
    assert main(["merge", str(tmp_path / "layers.safetensors"), str(tmp_path / "heads.safetensors"),
                 "-o", str(tmp_path / "both.safetensors")]) == 0
    assert RoleManifest.load(tmp_path / "both.safetensors").sections == ["layers", "heads"]


def one_error_line(capsys, command: str) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert not captured.out and "\n" not in err and "Errno" not in err, captured
    assert err.startswith(f"rolecall {command}: error: "), err
    return err


def test_manifest_commands_refuse_an_output_they_cannot_write_before_any_work(manifest_path, tmp_path, capsys):
    """Under a file, or a folder given for a file (a file given for duo's folder): one line naming the flag, before
    any input is read (the inputs here do not exist) or anything is printed, and no temporary file left behind."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    missing = str(tmp_path / "absent.safetensors")
    under = f"{blocker}/out.x: {blocker} is a file, not a folder; give a path you can write"
    runs = {
        "export": [["export", missing, "--format", "json", "-o", str(blocker / "out.x")], f"--output {under}"],
        "merge": [["merge", missing, missing, "-o", str(blocker / "out.x")], f"--output {under}"],
        "import": [["import", missing, "--format", "layers", "--model", "no-such-model", "-o", str(blocker / "out.x")],
                   f"--output {under}"],
        "inspect": [["inspect", str(manifest_path), "--plot", str(blocker / "out.x")], f"--plot {under}"],
    }
    for command, (argv, says) in runs.items():
        assert main(argv) == 2, command
        assert one_error_line(capsys, command).endswith(says)
    folder = tmp_path / "out"
    folder.mkdir()
    assert main(["export", missing, "--format", "json", "-o", str(folder)]) == 2
    assert one_error_line(capsys, "export").endswith(f"--output {folder}: a folder is there; give the path of a file")
    assert main(["inspect", str(manifest_path), "--plot", str(folder)]) == 2
    assert one_error_line(capsys, "inspect").endswith(f"--plot {folder}: a folder is there; give the path of a file")
    assert main(["export", missing, "--format", "duo", "-o", str(blocker)]) == 2
    assert one_error_line(capsys, "export").endswith(f"--output {blocker}: a file is there; give the path of a folder")
    assert blocker.read_text() == "x" and not any(folder.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "m.safetensors", "out"]


def test_import_names_a_missing_source_and_what_its_format_reads_before_the_model_is_looked_up(tmp_path, capsys):
    out = str(tmp_path / "m.safetensors")
    for source, fmt, says in ((tmp_path / "absent.json", "json", "no such file; --format json reads the JSON that "
                                                                 "rolecall export --format json writes"),
                              (tmp_path, "layers", "a folder; --format layers reads a layer list as rolecall export "
                                                   "--format layers writes it"),
                              (tmp_path / "absent", "duo", "no such file or folder; --format duo reads a DuoAttention "
                                                           "pattern folder or its full_attention_heads.tsv")):
        assert main(["import", str(source), "--format", fmt, "--model", "no-such-model", "-o", out]) == 2
        assert one_error_line(capsys, "import").startswith(f"rolecall import: error: {source}: {says}")
    assert not any(tmp_path.iterdir())


def test_a_folder_given_as_a_manifest_is_named_as_such(tmp_path, capsys):
    says = f"{tmp_path}: a folder, not a manifest file; give the path of a manifest file (.safetensors)"
    for argv in (["inspect", str(tmp_path)], ["inspect", str(tmp_path), "--verify"]):  # a usage error, not a failed check
        assert main(argv) == 2
        assert one_error_line(capsys, "inspect").endswith(says)


def test_inspect_shows_each_sections_metrics_of_a_merged_manifest(tmp_path, capsys):
    config = tiny_config("qwen2", layers=2, heads=4, kv_heads=2)
    identity = ModelIdentity.from_config(config, name="tiny-qwen2")
    RoleManifest(identity, layer_role=[0, 1], metrics={"recall_mean": 0.875, "drift": [0.1, 0.2]}).save(
        tmp_path / "layers.safetensors")
    RoleManifest(identity, head_role=torch.ones(2, 2, dtype=torch.int8), metrics={"steps": 7}).save(
        tmp_path / "heads.safetensors")
    both = tmp_path / "both.safetensors"
    assert main(["merge", str(tmp_path / "heads.safetensors"), str(tmp_path / "layers.safetensors"), "-o", str(both)]) == 0
    first = both.read_bytes()
    assert main(["merge", str(tmp_path / "layers.safetensors"), str(tmp_path / "heads.safetensors"), "-o", str(both)]) == 0
    assert both.read_bytes() == first  # same inputs, same bytes, whichever order they come in
    capsys.readouterr()
    assert main(["inspect", str(both)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("metrics")]
    assert lines == ['metrics      {"heads": {"steps": 7}, "layers": {"recall_mean": 0.875}}']
    RoleManifest(identity, layer_role=[0, 1], metrics={"drift": [0.1, 0.2]}).save(tmp_path / "arrays.safetensors")
    assert main(["inspect", str(tmp_path / "arrays.safetensors")]) == 0
    assert "metrics      (arrays only; --json shows them)" in capsys.readouterr().out.splitlines()


def test_engine_decode_line_names_speed_reads_and_cache_size():
    from types import SimpleNamespace

    from rolecall.cli.decode import engine_line

    last = SimpleNamespace(info={"attended_fraction": 0.25, "min_context": 32768, "cache_bytes": 3 * 2**20},
                           tokens=[[1, 2, 3]], prefill_s=0.012, steps=3, decode_s=0.5)
    line = engine_line(last, "cuda", 40, "lethe")
    assert line == ("\n[engine on cuda: 40 prompt tokens, 3 generated, prefill 12 ms, 6.0 tokens/s decoding; "
                    "policy lethe read 0.250 of the context; full attention below 32768 tokens; KV cache 3.0 MiB]")


def test_help_shows_the_defaults_a_run_without_flags_takes(capsys):
    """``--help`` names the value of the default model's shipped config where it overrides the dataclass's (the
    embedded model trains 8 heads on 1000–2000-token prompts at lr 0.02), and no reST markup."""
    import yaml

    from rolecall.calibrate.cli import build_parser as calibrate_parser
    from rolecall.train.cli import build_parser as train_parser

    shipped = yaml.safe_load((Path(__file__).parents[1] / "configs" / "train" / "smollm2-135m.yaml").read_text())
    text = " ".join(train_parser().format_help().split())
    assert f"(default {shipped['target']})" in text and f"(default {shipped['lr']};" in text
    assert f"(default {','.join(map(str, shipped['lengths']))})" in text
    text = " ".join(calibrate_parser().format_help().split())
    assert "``" not in text and "tokens generated per trace [" in text and "DELTA L: most recent pages always kept [" in text
