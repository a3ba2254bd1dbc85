"""Bad input is refused before any work starts, in one line naming the value, the limit and the fix.

Token ids outside the vocabulary, inputs longer than the model's context and impossible ``--target`` values,
through the real ``calibrate-delta``, ``train-heads`` and ``rolecall eval`` on a tiny model folder whose
context (``max_position_embeddings``) is 64 tokens. The model must never load for refused input: loading it
is patched to fail the test.
"""

from __future__ import annotations

import json

import pytest
import torch

import rolecall.core.distributed
import rolecall.core.models
from rolecall.calibrate import cli as calibrate_cli
from rolecall.cli import main as rolecall_main
from rolecall.core.models import ContextLengthError, check_context, context_limit
from rolecall.core.tokens import TokenIdError, check_token_ids
from rolecall.train import cli as train_cli
from tests.tiny import SHORT_CONTEXT, VOCAB_SIZE, short_context_folder, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
CONTEXT = SHORT_CONTEXT


def one_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"{prog}: error: ")
    return err


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---- the shared checks ----------------------------------------------------------------------------------------

def test_check_token_ids_names_the_sequence_the_id_and_the_range():
    check_token_ids([[0, 5], torch.tensor([VOCAB_SIZE - 1]), []], VOCAB_SIZE, "trace {n} of t.jsonl")
    with pytest.raises(TokenIdError, match=r"^trace 2 of t\.jsonl has token id 50000, the model's vocabulary has "
                       r"49152 ids \(0-49151\); re-tokenize it with this model's tokenizer$"):
        check_token_ids([[1, 2], [3, 50000, 4]], 49152, "trace {n} of t.jsonl")
    with pytest.raises(TokenIdError, match=r"sample 1 of \{odd\}\.jsonl has token id -1"):
        check_token_ids([torch.tensor([4, -1])], 49152, "sample {n} of {odd}.jsonl")
    with pytest.raises(TokenIdError, match="token id -7, but token ids are never negative"):
        check_token_ids([[3, -7]], None, "trace {n}")
    check_token_ids([[10**30]], None, "trace {n}")  # without a vocabulary only the sign is known
    with pytest.raises(TokenIdError, match=f"token id {10**30}"):
        check_token_ids([[10**30]], 100, "trace {n}")


def test_check_context_refuses_or_warns(capsys):
    config = tiny_model("llama", layers=2, max_position_embeddings=CONTEXT).config
    assert context_limit(config) == CONTEXT
    check_context(CONTEXT, CONTEXT, "x", "fix it")  # exactly the context fits
    with pytest.raises(ContextLengthError, match=r"^trace 1 is 65 tokens, more than the model's context of 64 "
                       r"\(max_position_embeddings\); cut it, or pass --allow-long-context"):
        check_context(CONTEXT + 1, CONTEXT, "trace 1", "cut it")
    check_context(CONTEXT + 1, CONTEXT, "trace 1", "cut it", allow_long=True, prog="p")
    assert capsys.readouterr().err.strip() == ("p: warning: trace 1 is 65 tokens, more than the model's context of 64 "
                                               "(max_position_embeddings); going on because of --allow-long-context")


def test_embedded_model_context_is_8192():
    # the alias's declared context, used when a config does not say (the embedded model's config says 8192 too)
    assert rolecall.core.models.resolve_model("smollm2-135m").context == 8192
    assert context_limit(object(), "smollm2-135m") == 8192


# ---- calibrate-delta ------------------------------------------------------------------------------------------

CALIBRATE = ["--stride", "4", "--min-context", "8", "--page-size", "4", "--num-pages", "2", "--recent-pages", "1",
             "--warmup", "1", "--num-delta", "1", "--min-gap", "1", "--bins", "2", "--device", "cpu", "--quiet",
             "--no-plots"]


@pytest.mark.parametrize("bad,message", [
    (VOCAB_SIZE + 40, f"token id {VOCAB_SIZE + 40}, the model's vocabulary has {VOCAB_SIZE} ids (0-{VOCAB_SIZE - 1})"),
    (-3, "token id -3, but token ids are never negative"),
])
def test_calibrate_refuses_token_ids_outside_the_vocabulary(short_context_dir, tmp_path, capsys, no_model, bad, message):
    traces = write_jsonl(tmp_path / "traces.jsonl", [{"ids": list(range(30))}, {"ids": [1, 2, bad, 4]}])
    out = tmp_path / "m.delta.safetensors"
    assert calibrate_cli.main(["--model", str(short_context_dir), "--traces", traces, "--output", str(out), *CALIBRATE]) == 2
    err = one_line(capsys, "calibrate-delta")
    assert f"trace 2 of {traces}" in err and message in err and "re-tokenize" in err
    assert not out.exists()


def test_calibrate_refuses_a_trace_beyond_the_context_unless_allowed(short_context_dir, tmp_path, capsys, monkeypatch,
                                                                     cache_dir):
    traces = write_jsonl(tmp_path / "traces.jsonl", [{"ids": list(range(40))}, {"ids": [i % 200 for i in range(80)]}])
    out = tmp_path / "m.delta.safetensors"
    argv = ["--model", str(short_context_dir), "--traces", traces, "--output", str(out), *CALIBRATE]
    with monkeypatch.context() as m:
        m.setattr(rolecall.core.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
        assert calibrate_cli.main(argv) == 2
    err = one_line(capsys, "calibrate-delta")
    assert f"trace 2 of {traces} is 80 tokens, more than the model's context of {CONTEXT}" in err
    assert "--allow-long-context" in err and not out.exists()
    # the override: one warning line, then the run goes on and writes the manifest
    assert calibrate_cli.main([*argv, "--allow-long-context"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "warning" in line] == [
        f"calibrate-delta: warning: trace 2 of {traces} is 80 tokens, more than the model's context of {CONTEXT} "
        "(max_position_embeddings); going on because of --allow-long-context"]
    assert out.is_file()


# ---- train-heads ----------------------------------------------------------------------------------------------

def train_args(short_context_dir, out, *extra):
    return ["--model", str(short_context_dir), "--output", str(out), "--target", "1", "--steps", "1", "--prefill-chunk",
            "16", "--device", "cpu", "--no-plots", *extra]


def sample(n: int, bad: int | None = None) -> dict:
    ids = [i % 250 for i in range(n)]
    if bad is not None:
        ids[n // 2] = bad
    return {"input_ids": ids, "labels": [-100] * (n - 4) + ids[n - 4:]}


@pytest.mark.parametrize("bad", [VOCAB_SIZE, 50000, -2])
def test_train_refuses_token_ids_outside_the_vocabulary(short_context_dir, tmp_path, capsys, no_model, bad):
    data = write_jsonl(tmp_path / "data.jsonl", [sample(24), sample(24, bad)])
    out = tmp_path / "heads.safetensors"
    assert train_cli.main(train_args(short_context_dir, out, "--dataset", data)) == 2
    err = one_line(capsys, "train-heads")
    assert f"sample 2 of {data} has token id {bad}, the model's vocabulary has {VOCAB_SIZE} ids " \
           f"(0-{VOCAB_SIZE - 1}); re-tokenize it with this model's tokenizer" in err
    assert not out.exists() and not out.with_name("heads.config.json").exists()


@pytest.mark.parametrize("target,message", [
    ("0", "target 0 asks for no retrieval heads"),
    ("-1", "target -1 asks for no retrieval heads"),
    # 2 layers × 2 KV heads: layer 0 is always retrieval, so 1 × 2 = 2 gates are learned
    ("3", "target 3 is more than the 2 gated heads"),
])
def test_train_refuses_an_impossible_target(short_context_dir, tmp_path, capsys, no_model, target, message):
    data = write_jsonl(tmp_path / "data.jsonl", [sample(24)])
    out = tmp_path / "heads.safetensors"
    assert train_cli.main(train_args(short_context_dir, out, "--dataset", data, "--target", target)) == 2
    err = one_line(capsys, "train-heads")
    assert message in err and "--target N" in err and not out.exists()
    if target == "3":
        assert "1 <= N <= 2" in err


def test_train_refuses_passkey_lengths_beyond_the_context(short_context_dir, tmp_path, capsys, no_model, monkeypatch):
    import rolecall.data.passkey

    monkeypatch.setattr(rolecall.data.passkey, "build_passkey_dataset", lambda *a, **k: pytest.fail("data was built"))
    out = tmp_path / "heads.safetensors"
    assert train_cli.main(train_args(short_context_dir, out, "--lengths", "20000,30000")) == 2
    err = one_line(capsys, "train-heads")
    assert (f"the longest haystack of --lengths 20000,30000 is 30000 tokens, more than the model's context of "
            f"{CONTEXT}" in err) and f"pass --lengths within {CONTEXT}" in err and "--allow-long-context" in err
    assert not out.exists()


def test_train_refuses_a_long_sample_unless_allowed(short_context_dir, tmp_path, capsys, monkeypatch):
    data = write_jsonl(tmp_path / "data.jsonl", [sample(24), sample(CONTEXT + 16)])
    out = tmp_path / "heads.safetensors"
    with monkeypatch.context() as m:
        m.setattr(rolecall.core.distributed, "load_frozen_model", lambda *a, **k: pytest.fail("model loaded"))
        assert train_cli.main(train_args(short_context_dir, out, "--dataset", data)) == 2
    err = one_line(capsys, "train-heads")
    assert f"sample 2 of {data} is {CONTEXT + 16} tokens, more than the model's context of {CONTEXT}" in err
    assert not out.exists()
    assert train_cli.main(train_args(short_context_dir, out, "--dataset", data, "--allow-long-context")) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and warnings[0].startswith("train-heads: warning: sample 2 of")
    assert out.is_file()


# ---- rolecall eval --------------------------------------------------------------------------------------------

def test_eval_refuses_lengths_beyond_the_context(short_context_dir, tmp_path, capsys, no_model, monkeypatch):
    import rolecall.data.passkey

    monkeypatch.setattr(rolecall.data.passkey, "build_niah_dataset", lambda *a, **k: pytest.fail("prompts were built"))
    out = tmp_path / "eval.json"
    code = rolecall_main(["eval", "--model", str(short_context_dir), "--policy", "full", "--lengths", "32", "20000",
                          "--max-new-tokens", "4", "--json", str(out)])
    assert code == 2
    err = one_line(capsys, "rolecall eval")
    assert f"--lengths 20000 plus --max-new-tokens 4 is 20004 tokens, more than the model's context of {CONTEXT}" in err
    assert f"pass --lengths of at most {CONTEXT - 4} tokens" in err and "--allow-long-context" in err
    assert not out.exists()


def test_eval_refuses_a_long_prompt_file_unless_allowed(short_context_dir, tmp_path, capsys, monkeypatch):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "a" * 20, "answer": "b"}, {"prompt": "c" * 70}])
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(short_context_dir), "--policy", "full", "--prompts", prompts, "--max-new-tokens", "3",
            "--device", "cpu", "--json", str(out)]
    with monkeypatch.context() as m:
        m.setattr(rolecall.core.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
        assert rolecall_main(argv) == 2
    err = one_line(capsys, "rolecall eval")
    assert f"the longest prompt of {prompts} (70 tokens) plus --max-new-tokens 3 is 73 tokens" in err
    assert not out.exists()
    assert rolecall_main([*argv, "--allow-long-context"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and warnings[0].startswith("rolecall eval: warning: the longest prompt")
    assert out.is_file()


def test_target_counts_only_the_learned_gates_of_a_hybrid_model():
    from rolecall.train.config import TrainConfig, check_settings
    from tests.tiny import tiny_config

    config = tiny_config("gemma3", layers=6, kv_heads=1)  # sliding 0, 1, 3, 4; layer 2 is the first full one
    check_settings(TrainConfig(target=1, dataset="data.jsonl"), config)  # layer 5 alone is learned
    with pytest.raises(ValueError, match=r"target 2 is more than the 1 gated heads .*less 4 held-open layer\(s\).*"
                                         r"1 <= N <= 1"):
        check_settings(TrainConfig(target=2, dataset="data.jsonl"), config)
    check_settings(TrainConfig(target=5, dataset="data.jsonl", include_sliding=True), config)  # 5 layers × 1


@pytest.mark.parametrize("command", ["decode", "eval"])
def test_a_bad_manifest_is_refused_before_the_model_loads(short_context_dir, tmp_path, capsys, no_model, command):
    extra = ["--prompt", "hi"] if command == "decode" else ["--lengths", "32"]
    missing = tmp_path / "nope.safetensors"
    assert rolecall_main([command, "--model", str(short_context_dir), "--policy", "delta", "--manifest", str(missing),
                          *extra]) == 2
    assert one_line(capsys, f"rolecall {command}").endswith(f"{missing}: no such manifest file")
    assert rolecall_main([command, "--model", str(short_context_dir), "--policy", "delta", "--manifest", str(tmp_path),
                          *extra]) == 2  # a folder: said so, not "no such manifest file"
    assert one_line(capsys, f"rolecall {command}").endswith(f"{tmp_path}: a folder, not a manifest file; give the path "
                                                            "of a manifest file (.safetensors)")


@pytest.mark.parametrize("command", ["decode", "eval"])
def test_a_manifest_the_policy_or_model_cannot_use_is_refused_before_the_model_loads(short_context_dir, tmp_path, capsys,
                                                                                     no_model, command):
    """Checked against the model's config, read without its weights: delta without layer roles, lychee without head
    roles, and a manifest of another model."""
    from rolecall.core.manifest import ModelIdentity, RoleManifest
    from tests.tiny import tiny_config

    extra = ["--prompt", "hi"] if command == "decode" else ["--lengths", "32"]
    run = [command, "--model", str(short_context_dir), *extra]
    assert rolecall_main([*run, "--policy", "delta"]) == 2
    assert "policy 'delta' needs a manifest with a layers section" in one_line(capsys, f"rolecall {command}")
    config = tiny_config("llama", layers=2, heads=4, kv_heads=2, max_position_embeddings=CONTEXT)
    layers = RoleManifest(ModelIdentity.from_config(config, name="tiny"), layer_role=[0, 1]).save(tmp_path / "l.safetensors")
    assert rolecall_main([*run, "--policy", "lychee", "--manifest", str(layers)]) == 2
    assert "policy 'lychee' needs" in one_line(capsys, f"rolecall {command}")
    other = tiny_config("llama", layers=3, heads=4, kv_heads=2, max_position_embeddings=CONTEXT)
    three = RoleManifest(ModelIdentity.from_config(other, name="other"), layer_role=[0, 1, 2]).save(tmp_path / "o.safetensors")
    assert rolecall_main([*run, "--policy", "delta", "--manifest", str(three)]) == 2
    assert "model.num_layers is 3 in the manifest (other) but 2 in the model" in one_line(capsys, f"rolecall {command}")


@pytest.mark.parametrize("command", ["decode", "eval"])
def test_a_device_this_machine_lacks_is_refused_before_the_model_loads(short_context_dir, capsys, no_model, command):
    extra = ["--prompt", "hi"] if command == "decode" else ["--lengths", "32"]
    run = [command, "--model", str(short_context_dir), "--policy", "full", *extra]
    assert rolecall_main([*run, "--device", "tpu"]) == 2
    assert one_line(capsys, f"rolecall {command}").endswith("--device 'tpu': use cpu, cuda or cuda:N")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert rolecall_main([*run, "--device", f"cuda:{gpus}"]) == 2
    assert f"--device cuda:{gpus}: this machine has " in one_line(capsys, f"rolecall {command}")


@pytest.mark.parametrize("command", ["decode", "eval"])
def test_a_device_map_beside_a_device_is_refused_before_the_model_loads(short_context_dir, capsys, no_model, command):
    extra = ["--prompt", "hi"] if command == "decode" else ["--lengths", "32"]
    assert rolecall_main([command, *extra, "--model", str(short_context_dir), "--policy", "full", "--device-map", "auto",
                          "--device", "cpu"]) == 2
    assert one_line(capsys, f"rolecall {command}").endswith("--device-map auto places the model itself; leave "
                                                            "--device cpu out")


def test_decode_with_a_device_map_runs_the_transformers_path(short_context_dir, capsys):
    """A model placed by --device-map (here all of it on the CPU) decodes on the transformers path."""
    assert rolecall_main(["decode", "--model", str(short_context_dir), "--policy", "full", "--prompt", "hi", "--device-map",
                          "cpu", "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "[transformers path on --device-map cpu: " in err and ", 3 generated" in err


@pytest.mark.parametrize("extra,says", [
    (["--prompts", "p.jsonl"], "--prompts p.jsonl: give --out FILE, the JSONL file the completions go to"),
    (["--prompt", "hi", "--out", "o.jsonl"], "--out and --batch-size go with --prompts FILE; --prompt's text is "
                                             "streamed"),
    (["--prompts", "p.jsonl", "--out", "o.jsonl", "--layers"], "--layers prints the layers of one prompt's decode; "
                                                               "leave it out with --prompts"),
    (["--prompts", "missing.jsonl", "--out", "o.jsonl"], "--prompts missing.jsonl: no such file; give a JSONL file"),
    (["--prompts", "p.jsonl", "--out", "o.jsonl", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--prompts", "p.jsonl", "--out", "o.jsonl", "--batch-size", "4", "--device", "cpu"],
     "--batch-size 4: the CPU runs the transformers path, which decodes one prompt at a time"),
    (["--prompts", "p.jsonl", "--out", "p.jsonl/o.jsonl"], "--out p.jsonl/o.jsonl: "),
    (["--prompts", "bad.jsonl", "--out", "o.jsonl"], "bad.jsonl:2: each line must be a JSON object with a 'prompt' "
                                                     "string"),
])
def test_decode_refuses_a_prompt_file_it_cannot_run_before_the_model_loads(short_context_dir, tmp_path, capsys, no_model,
                                                                           monkeypatch, extra, says):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "hi"}, {"text": "no prompt key"}])
    assert rolecall_main(["decode", "--model", str(short_context_dir), "--policy", "full", *extra]) == 2
    assert says in one_line(capsys, "rolecall decode")
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.jsonl.partial").exists()


@pytest.mark.parametrize("prompt", ["", "   "])
def test_decode_refuses_an_empty_prompt_before_the_model_loads(short_context_dir, capsys, no_model, prompt):
    assert rolecall_main(["decode", "--model", str(short_context_dir), "--policy", "full", "--prompt", prompt]) == 2
    assert "--prompt is empty" in one_line(capsys, "rolecall decode")


def test_decode_refuses_chat_without_a_template_before_the_model_loads(tmp_path, capsys, no_model):
    folder = short_context_folder(tmp_path / "base")
    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings.pop("chat_template", None)
    config.write_text(json.dumps(settings))
    for extra in folder.glob("chat_template.*"):  # newer tokenizers keep the template in a file of its own
        extra.unlink()
    capsys.readouterr()  # saving the folder's progress
    assert rolecall_main(["decode", "--model", str(folder), "--policy", "full", "--prompt", "hi", "--chat"]) == 2
    err = one_line(capsys, "rolecall decode")
    assert "has no chat template" in err and "leave out --chat" in err


@pytest.mark.parametrize("flag", ["--samples-per-cell", "--passkey-words"])
def test_eval_refuses_zero_counts_in_the_flags_words(short_context_dir, capsys, no_model, flag):
    assert rolecall_main(["eval", "--model", str(short_context_dir), "--policy", "full", flag, "0"]) == 2
    assert f"{flag} must be at least 1, got 0" in one_line(capsys, "rolecall eval")


@pytest.mark.parametrize("flags,says", [
    (["--sample", "--temperature", "0"], "--temperature must be > 0 when sampling, got 0.0; leave out --sample for greedy decoding"),
    (["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    (["--top-k", "-3"], "--top-k must be an integer ≥ 0 (0 = off), got -3"),
])
def test_decode_refuses_bad_sampling_flags_before_the_model_loads(short_context_dir, capsys, no_model, flags, says):
    """Checked as the engine's sampler checks them, so the transformers path (which let --top-p 2 through) refuses
    the same values."""
    assert rolecall_main(["decode", "--model", str(short_context_dir), "--policy", "full", "--prompt", "hi", *flags]) == 2
    assert one_line(capsys, "rolecall decode").endswith(says)


@pytest.mark.parametrize("flags,says", [
    (["--temperature", "1.3"], "--temperature 1.3 applies only when sampling, and decoding is greedy without --sample; "
     "add --sample, or leave it out"),
    (["--top-p", "0.9", "--seed", "3"], "--top-p 0.9, --seed 3 apply only when sampling, and decoding is greedy "
     "without --sample; add --sample, or leave them out"),
])
def test_decode_refuses_sampling_flags_without_sample(short_context_dir, capsys, no_model, flags, says):
    """Greedy decoding would ignore them: the text would come out as if they had not been given."""
    assert rolecall_main(["decode", "--model", str(short_context_dir), "--policy", "full", "--prompt", "hi", *flags]) == 2
    assert one_line(capsys, "rolecall decode").endswith(says)


def test_decode_sampling_flags_left_out_take_the_samplers_defaults():
    import argparse

    from rolecall.cli import decode as decode_cli

    parser = argparse.ArgumentParser()
    decode_cli.add_arguments(parser)
    args = parser.parse_args(["--policy", "full", "--prompt", "hi", "--sample", "--top-k", "5"])
    decode_cli.check_flags(args)
    assert (args.temperature, args.top_k, args.top_p, args.seed) == (1.0, 5, 1.0, 0)
    greedy = parser.parse_args(["--policy", "full", "--prompt", "hi"])
    decode_cli.check_flags(greedy)
    assert (greedy.sample, greedy.temperature, greedy.top_k, greedy.top_p, greedy.seed) == (False, 1.0, 0, 1.0, 0)


def test_calibrate_refuses_sampling_flags_for_greedy_traces(short_context_dir, tmp_path, capsys, no_model):
    out = tmp_path / "m.delta.safetensors"
    assert calibrate_cli.main(["--model", str(short_context_dir), "--output", str(out), "--temperature", "0.9",
                               *CALIBRATE]) == 2
    assert one_line(capsys, "calibrate-delta").endswith(
        "--temperature 0.9 applies only when sampling, and traces are greedy without --sample; add --sample, or "
        "leave it out")
    assert not out.exists()


def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(short_context_dir, tmp_path, capsys, no_model):
    """eval's --json, the benchmarks' --out and the manifests of calibrate-delta and train-heads are written at the
    end, after minutes or hours of work: a path under a file, or a folder given as the file, is refused first, in
    one line."""
    from rolecall.core.atomic import check_writable

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=f"^--json {blocker}/out.json: {blocker} is a file, not a folder; give a"):
        check_writable(blocker / "out.json", "--json")
    with pytest.raises(ValueError, match=f"^--out {tmp_path}: a folder is there; give the path of a file$"):
        check_writable(tmp_path, "--out")
    check_writable(tmp_path / "new" / "deeper" / "out.json", "--out")  # its folders are made, nothing else stays
    assert (tmp_path / "new" / "deeper").is_dir() and not any((tmp_path / "new" / "deeper").iterdir())
    assert rolecall_main(["eval", "--model", str(short_context_dir), "--policy", "full", "--lengths", "32", "--json",
                          str(blocker / "out.json")]) == 2
    assert f"{blocker} is a file" in one_line(capsys, "rolecall eval")
    from benchmarks import decode as bench

    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke", "--out", str(blocker / "decode.json")])
    assert f"--out {blocker}/decode.json: {blocker} is a file" in capsys.readouterr().err
    traces = write_jsonl(tmp_path / "traces.jsonl", [{"ids": list(range(30))}])
    assert calibrate_cli.main(["--model", str(short_context_dir), "--traces", traces, "--output", str(blocker / "m.safetensors"),
                               *CALIBRATE]) == 2
    assert f"--output {blocker}/m.safetensors: {blocker} is a file" in one_line(capsys, "calibrate-delta")
    data = write_jsonl(tmp_path / "data.jsonl", [sample(40)])
    assert train_cli.main(train_args(short_context_dir, blocker / "h.safetensors", "--dataset", data)) == 2
    assert f"--output {blocker}/h.safetensors: {blocker} is a file" in one_line(capsys, "train-heads")


def test_a_missing_prompt_file_is_refused_before_anything_loads(short_context_dir, tmp_path, capsys, no_model):
    missing = tmp_path / "prompts.jsonl"
    assert rolecall_main(["eval", "--model", str(short_context_dir), "--policy", "full", "--prompts", str(missing)]) == 2
    assert one_line(capsys, "rolecall eval").endswith(f'--prompts {missing}: no such file; give a JSONL file of '
                                                      '{"prompt": ..., "answer": ...} lines')


def test_eval_sizes_a_prompt_file_by_its_own_budget_whatever_the_suite(short_context_dir, tmp_path, capsys):
    """A prompt file's rows carry no RULER task, so --max-new-tokens (not the suite's largest task budget,
    128 tokens) decides whether they fit the model's context."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "a" * 20, "answer": "b"}])
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(short_context_dir), "--policy", "full", "--prompts", prompts, "--max-new-tokens", "3",
            "--suite", "ruler", "--device", "cpu", "--json", str(out)]
    assert rolecall_main(argv) == 0
    assert "warning" not in capsys.readouterr().err and out.is_file()
