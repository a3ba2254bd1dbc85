"""Evaluation and the decode / eval commands, end to end on a tiny model saved to a folder."""

import json

import pytest
import torch

from rolecall.cli import main
from rolecall.core.manifest import ModelIdentity, RoleManifest
from rolecall.eval import (
    EvalSettings,
    answer_correct,
    evaluate,
    format_table,
    step_divergence,
    suite_prompts,
)
from tests.tiny import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    model.generation_config.pad_token_id = 259
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    manifest = RoleManifest(ModelIdentity.from_config(model.config), layer_role=torch.tensor([0, 1, 2, 2], dtype=torch.int8))
    manifest.save(folder / "delta.safetensors")
    text = "the quick brown fox jumps over the lazy dog; " * 3
    (folder / "prompts.jsonl").write_text(
        json.dumps({"prompt": text + "the passkey is", "answer": "zulu"}) + "\n" + json.dumps({"prompt": text}) + "\n")
    return folder


def test_step_divergence_closed_form():
    full = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))
    policy = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.2, 0.7]]))
    kl, top1 = step_divergence(full, policy)
    assert kl[0] == pytest.approx(0.5 * torch.log(torch.tensor(2.0)).item() + 0.25 * torch.log(torch.tensor(0.5)).item())
    assert kl[1] == pytest.approx(0.0, abs=1e-7)
    assert top1.tolist() == [False, True]


def test_answer_correct():
    assert answer_correct(" Zulu, alpha.", "zulu alpha") and not answer_correct("alpha zulu", "zulu alpha")


def test_full_policy_has_no_error_and_sparse_delta_has_some(tiny_folder):
    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    tok = tiny_tokenizer()
    settings = EvalSettings(prompts=str(tiny_folder / "prompts.jsonl"), max_new_tokens=6)
    full = evaluate(model, tok, None, "full", settings=settings)
    assert full["kl_mean"] < 1e-6 and full["top1_agreement"] == 1.0
    assert all(layer["recall"] == pytest.approx(1.0) for layer in full["layers"])
    manifest = tiny_folder / "delta.safetensors"
    sparse = evaluate(model, tok, manifest, "delta", {"num_pages": 2, "recent_pages": 1, "page_size": 4}, settings)
    assert sparse["kl_mean"] > 1e-4
    recalls = [layer["recall"] for layer in sparse["layers"]]
    assert recalls[0] == pytest.approx(1.0) and recalls[1] == pytest.approx(1.0)
    assert 0 < recalls[2] < 1 and 0 < recalls[3] < 1
    assert sparse["attended_fraction"] < 1
    assert sparse["samples"][0]["correct"] is not None and sparse["samples"][1]["correct"] is None
    length = str(sparse["samples"][0]["context_length"])  # a prompt file's row: scored as task "prompts", no grid
    assert sparse["passkey_grid"] == {} and sparse["passkey_accuracy"] is None
    assert sparse["tasks"]["prompts"][length]["score"] == float(sparse["samples"][0]["correct"])
    evicting = evaluate(model, tok, None, "lethe", {"budget": 12}, settings)
    assert all(layer["recall"] < 1 for layer in evicting["layers"])  # evicted mass counts as missed
    assert all(layer["kept_fraction"] < 0.5 for layer in evicting["layers"])


def test_time_split_sums_the_timed_batches_and_leaves_out_the_others():
    """Closed form over hand-made checkpoint entries: the parts are summed over the batches that carry them
    (an entry kept before timings were recorded has none), ``other`` is what the parts leave of the total."""
    from rolecall.eval import time_split

    def entry(prefill, decode, total):
        seconds = {"setup": 0.5, "prefill": prefill, "capture": 0.25, "decode": decode, "reference": 0.25,
                   "total": total}
        return {"figures": {"fraction": 1.0, "kv_bytes": 1.0, "seconds": seconds}}

    old = {"figures": {"fraction": 1.0, "kv_bytes": 1.0}}
    split = time_split([entry(1.0, 2.0, 5.0), old, entry(3.0, 4.0, 9.0), {"figures": None}])
    assert split == {"batches": 2, "setup": 1.0, "prefill": 4.0, "capture": 0.5, "decode": 6.0, "reference": 0.5,
                     "total": 14.0, "other": 2.0}
    assert time_split([old, {"figures": None}]) is None


def test_engine_evaluation_reports_the_kv_cache_a_prompt_held(tiny_folder):
    """On the engine (forced on the CPU) every prompt's KV cache is counted: full attention holds prompt +
    new tokens in every layer, Lethe's compact layers capacity + 1 once its first step has evicted (the prompt's
    K/V are held in full only until then); off the engine: None."""
    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    tok = tiny_tokenizer()
    settings = EvalSettings(prompts=str(tiny_folder / "prompts.jsonl"), max_new_tokens=8)
    full = evaluate(model, tok, None, "full", {"engine": "static"}, settings, batch_size=1)
    lethe = evaluate(model, tok, None, "lethe", {"engine": "static", "budget": 12}, settings, batch_size=1)
    per_slot = 4 * 2 * 2 * 16 * 4  # layers, K and V, 2 KV heads of 16 float32 values
    prompts = [len(s["input_ids"]) for s in suite_prompts(tok, settings)]
    assert min(prompts) > 12  # Lethe's budget binds: its layers end with 13 slots, not the prompt or new tokens
    assert full["kv_bytes_per_prompt"] == per_slot * sum(p + 8 for p in prompts) / len(prompts)
    assert lethe["kv_bytes_per_prompt"] == per_slot * 13
    assert "KV cache" in format_table(lethe)
    assert "time " in format_table(lethe) and lethe["seconds"]["batches"] == len(prompts)
    assert evaluate(model, tok, None, "full", settings=settings)["kv_bytes_per_prompt"] is None


def test_eval_and_decode_commands(tiny_folder, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = main(["eval", "--model", str(tiny_folder), "--manifest", str(tiny_folder / "delta.safetensors"),
                 "--policy", "delta", "-p", "num_pages=2", "-p", "page_size=4", "-p", "recent_pages=1",
                 "--prompts", str(tiny_folder / "prompts.jsonl"), "--max-new-tokens", "4", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "recall" in printed and "passkey accuracy" not in printed  # a prompt file's rows are not passkeys ...
    result = json.loads(out.read_text())
    assert [r["task"] for r in result["samples"]] == ["prompts", "prompts"] and result["passkey_grid"] == {}
    first = str(result["samples"][0]["context_length"])
    assert list(result["tasks"]) == ["prompts"] and result["tasks"]["prompts"][first]["n"] == 1  # one with an answer
    assert result["params"] == {"num_pages": 2, "page_size": 4, "recent_pages": 1} and len(result["layers"]) == 4
    code = main(["decode", "--model", str(tiny_folder), "--policy", "lethe", "-p", "budget=16", "--prompt",
                 "hello world " * 10, "--max-new-tokens", "5", "--layers"])
    assert code == 0
    captured = capsys.readouterr()  # the text streams to stdout, the summary goes to stderr
    assert "attended fraction" in captured.err and "kept" in captured.out


def test_bad_policy_on_the_command_line_is_one_line(tiny_folder, capsys):
    code = main(["decode", "--model", str(tiny_folder), "--policy", "sparse", "--prompt", "hi"])
    assert code == 2
    err = capsys.readouterr().err.strip()  # the policy is checked before the model loads
    assert "unknown policy 'sparse'" in err and "delta" in err and "\n" not in err


@pytest.mark.slow
def test_eval_on_the_embedded_model(tmp_path, capsys):
    from rolecall.core.models import load_model

    model = load_model("smollm2-135m")
    roles = [0, 0, 1] + [2] * 7 + [1] + [2] * 19
    manifest = RoleManifest(ModelIdentity.from_config(model.config), layer_role=torch.tensor(roles, dtype=torch.int8))
    manifest.save(tmp_path / "delta.safetensors")
    del model
    code = main(["eval", "--model", "smollm2-135m", "--manifest", str(tmp_path / "delta.safetensors"), "--policy",
                 "delta", "-p", "budget=256", "--lengths", "600", "--depths", "0.5", "--max-new-tokens", "6",
                 "--json", str(tmp_path / "eval.json")])
    assert code == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["passkey_accuracy"] is not None and len(result["layers"]) == 30
    assert list(result["passkey_grid"]) == ["600"] and list(result["passkey_grid"]["600"]) == ["0.5"]
    assert result["attended_fraction"] < 1
    assert "passkey accuracy" in capsys.readouterr().out


def test_passkey_prompts_follow_the_alphabet():
    from rolecall.eval import EvalSettings, passkey_prompts
    from tests.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    for alphabet, check in (("digits", str.isdigit), ("nato", str.isalpha)):
        settings = EvalSettings(lengths=(600,), depths=(0.5,), passkey_words=5, alphabet=alphabet)
        (sample,) = passkey_prompts(tok, settings)
        answer = sample["answer"].replace(" ", "")
        assert check(answer), (alphabet, sample["answer"])
        assert sample["answer"] in tok.decode(sample["input_ids"])


def test_wilson_interval_closed_form():
    from rolecall.eval import wilson_interval

    low, high = wilson_interval(99, 100)  # the values the quality reports quote for 99 of 100
    assert (round(low, 3), round(high, 3)) == (0.946, 0.998)
    low, high = wilson_interval(83, 100)
    assert (round(low, 3), round(high, 3)) == (0.745, 0.891)
    low, high = wilson_interval(0, 10)  # z² / (n + z²) above zero, never below
    assert low == 0.0 and high == pytest.approx(1.959964**2 / (10 + 1.959964**2))
    with pytest.raises(ValueError, match="n >= 1"):
        wilson_interval(0, 0)


@pytest.fixture(scope="module")
def ascii_corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("essays")
    words = ("river", "stone", "lantern", "orchard", "meadow", "harbour", "quiet", "morning", "copper", "window",
             "garden", "silver", "thunder", "pebble", "candle", "forest", "mirror", "ladder", "valley", "feather")
    for i in range(3):
        (folder / f"e{i}.txt").write_text(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(2000)) + ".")
    return f"text:{folder}"


def test_eval_runs_the_ruler_suite_with_intervals(tiny_folder, ascii_corpus, tmp_path, capsys):
    out = tmp_path / "ruler.json"
    code = main(["eval", "--model", str(tiny_folder), "--policy", "full", "--suite", "ruler", "--tasks",
                 "niah_single_noise", "variable_tracking", "--lengths", "300", "--samples-per-cell", "2",
                 "--source", ascii_corpus, "--json", str(out)])
    assert code == 0
    assert "Wilson 95 %" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result["tasks"]) == {"niah_single_noise", "variable_tracking"}
    for by_length in result["tasks"].values():
        cell = by_length["300"]
        assert cell["n"] == 2 and cell["interval"][0] <= cell["score"] <= cell["interval"][1]
    by_task = {r["task"]: r["generated_tokens"] for r in result["samples"]}
    assert by_task["variable_tracking"] <= 30  # its own budget (12 is eval's default for other prompts)
    assert result["kl_mean"] < 1e-6  # full attention against itself


def test_unknown_ruler_task_is_one_line_before_loading(tiny_folder, capsys):
    code = main(["eval", "--model", str(tiny_folder), "--policy", "full", "--suite", "ruler", "--tasks", "niah"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "unknown RULER task(s) niah" in err and "niah_single_noise" in err and "\n" not in err


def test_eval_runs_longbench_from_a_local_copy_and_scores_with_each_task_metric(tiny_folder, tmp_path, capsys,
                                                                                 monkeypatch):
    from rolecall.data.longbench import score

    data = tmp_path / "longbench"
    data.mkdir()
    for task, answers, classes in (("hotpotqa", ["river"], None), ("trec", ["Number"], ["Number", "Location"])):
        rows = [{"input": f"q{i}", "context": "the river runs to the sea " * 30, "answers": answers,
                 "all_classes": classes, "_id": str(i)} for i in range(3)]
        (data / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "lb.json"
    code = main(["eval", "--model", str(tiny_folder), "--policy", "full", "--suite", "longbench", "--data", str(data),
                 "--tasks", "hotpotqa", "trec", "--lengths", "120", "--samples-per-cell", "2", "--json", str(out)])
    assert code == 0
    capsys.readouterr()
    result = json.loads(out.read_text())
    assert {t: by_length["120"]["n"] for t, by_length in result["tasks"].items()} == {"hotpotqa": 2, "trec": 2}
    for r in result["samples"]:
        assert r["context_length"] == 120
        classes = ["Number", "Location"] if r["task"] == "trec" else None
        assert r["score"] == score(r["task"], r["generated"], r["answer"], classes)
    assert max(r["generated_tokens"] for r in result["samples"] if r["task"] == "hotpotqa") <= 32  # its budget

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no --data, no Hub: one line, before the model loads
    code = main(["eval", "--model", str(tiny_folder), "--policy", "full", "--suite", "longbench", "--lengths", "120"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "THUDM/LongBench" in err and "--data PATH" in err and "\n" not in err


def test_reasoning_fidelity_full_is_exact_and_a_small_budget_diverges(tiny_folder, tmp_path, capsys):
    out = tmp_path / "fidelity.json"
    common = ["eval", "--model", str(tiny_folder), "--suite", "reasoning", "--reasoning-source", "arithmetic:3",
              "--limit", "3", "--max-new-tokens", "40"]
    assert main([*common, "--policy", "full", "--json", str(out)]) == 0
    assert "median divergence point" in capsys.readouterr().out
    full = json.loads(out.read_text())
    assert full["prompts"] == 3 and full["kl_mean"] == 0.0 and full["top1_agreement"] == 1.0
    assert full["never_diverged"] == 1.0 and all(r["divergence"] is None for r in full["samples"])
    assert main([*common, "--policy", "delta", "--manifest", str(tiny_folder / "delta.safetensors"), "-p",
                 "num_pages=1", "-p", "page_size=4", "-p", "recent_pages=1", "--json", str(out)]) == 0
    sparse = json.loads(out.read_text())
    assert sparse["kl_mean"] > 1e-4 and sparse["top1_agreement"] < 1.0
    for r, f in zip(sparse["samples"], full["samples"]):  # the same full trace is followed
        assert r["generated_tokens"] == f["generated_tokens"] and len(r["kl"]) == r["generated_tokens"] - 1
        if r["divergence"] is not None:  # the first disagreeing step, 1-based after the prefill's token
            assert r["divergence"] >= 2 and r["top1_agreement"] < 1.0
    assert any(r["divergence"] is not None for r in sparse["samples"])


def test_reasoning_suite_refuses_a_policy_without_an_engine_step(tiny_folder, capsys):
    code = main(["eval", "--model", str(tiny_folder), "--suite", "reasoning", "--policy", "lethe", "-p",
                 "sparse_ratio=0.5"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "runs on the engine" in err and "budget=N" in err


def test_bootstrap_interval_matches_the_normal_approximation():
    from rolecall.eval import bootstrap_interval

    values = torch.randn(400, generator=torch.Generator().manual_seed(1)).tolist()
    low, high = bootstrap_interval(values, [1.0] * 400, reps=4000)
    mean, half = sum(values) / 400, 1.96 * float(torch.tensor(values).std()) / 400**0.5
    assert abs(low - (mean - half)) < 0.15 * half and abs(high - (mean + half)) < 0.15 * half
    assert bootstrap_interval(values, [1.0] * 400, reps=4000) == (low, high)  # the same inputs, the same interval
    assert bootstrap_interval([0.3, 0.3, 0.3], [5, 1, 2]) == pytest.approx((0.3, 0.3))
    heavy = bootstrap_interval([0.0, 1.0], [1.0, 99.0])  # a weight counts as that many steps of its prompt
    assert heavy[1] == pytest.approx(1.0) and heavy[0] < 0.5
    with pytest.raises(ValueError, match="one weight per value"):
        bootstrap_interval([1.0], [])


def _delta_on_the_engine(tiny_folder):
    """A tiny model, its tokenizer, passkey settings at two lengths, a DELTA manifest and engine parameters."""
    settings = EvalSettings(lengths=(260, 330), depths=(0.2, 0.8), samples_per_cell=2, max_new_tokens=5,
                            alphabet="digits")
    params = {"engine": "static", "num_pages": 3, "recent_pages": 1, "page_size": 8}
    return (tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16), tiny_tokenizer(), settings,
            tiny_folder / "delta.safetensors", params)


def test_a_batched_evaluation_scores_every_prompt_as_one_at_a_time(tiny_folder):
    """Batches on the engine (CPU, naive kernels), full and partial: the same generations, scores and per-step
    KL as evaluating each prompt alone, reported in the prompts' own order."""
    model, tok, settings, manifest, params = _delta_on_the_engine(tiny_folder)
    alone = evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=1)
    batched = evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=3)
    assert len(alone["samples"]) == len(batched["samples"]) == 8  # per length a batch of 3 and one of 1
    assert [s["depth"] for s in batched["samples"]] == [s["depth"] for s in alone["samples"]]
    for a, b in zip(alone["samples"], batched["samples"]):
        assert (a["generated"], a["score"], a["generated_tokens"]) == (b["generated"], b["score"], b["generated_tokens"])
        assert b["kl_mean"] == pytest.approx(a["kl_mean"], rel=1e-3, abs=1e-6)
    assert batched["kl_mean"] == pytest.approx(alone["kl_mean"], rel=1e-3) and alone["kl_mean"] > 1e-5


def test_the_engine_reference_of_a_trace_equals_one_transformers_forward(tiny_folder, monkeypatch):
    """On the engine the full-attention reference of each step comes from a dense pass over the generated tokens
    on the prompt's cached K/V; per prompt its KL and top-1 agreement equal those of the path a policy that
    evicted prompt keys takes (the same pass over a copy of the prefill, in a full-attention cache), and those
    against one transformers forward over prompt and trace (the path off the engine)."""
    from rolecall.eval import decoding
    model, tok, settings, manifest, params = _delta_on_the_engine(tiny_folder)
    cached = evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=3)
    monkeypatch.setattr(decoding, "keeps_prompt", lambda dec: False)
    copied = evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=3)
    monkeypatch.setattr(decoding, "Traced", _without_reference(decoding.Traced))
    forward = evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=3)
    assert cached["kl_mean"] > 1e-5
    # one transformers forward sums in another order: KLs of about 5e-4 then differ by float32 rounding (1.3e-7 on
    # some CPUs), far below what a wrong reference token or position would move
    for other, tol in ((copied, 1e-7), (forward, 1e-6)):
        for a, b in zip(cached["samples"], other["samples"]):
            assert a["generated"] == b["generated"]
            assert a["kl_mean"] == pytest.approx(b["kl_mean"], rel=1e-4, abs=tol)
            assert a["top1_agreement"] == b["top1_agreement"]


def _without_reference(cls):
    """``Traced`` that drops its reference logits, so an evaluation falls back to one transformers forward."""
    def make(*args, **kwargs):
        out = cls(*args, **kwargs)
        out.reference_logits = None
        return out
    return make


def test_a_batch_on_the_transformers_path_is_refused_in_one_line(tiny_folder):
    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    settings = EvalSettings(prompts=str(tiny_folder / "prompts.jsonl"), max_new_tokens=4)
    with pytest.raises(ValueError, match="batch_size 4 needs the engine"):
        evaluate(model, tiny_tokenizer(), None, "full", settings=settings, batch_size=4)


def test_a_batch_that_cannot_run_is_refused_before_the_prompts_are_built(tiny_folder, capsys, monkeypatch):
    """A batch size on the CPU or with --measure is refused in one line naming the flag, the reason and the fix,
    before any prompt is built or model loaded (the quality script: tests/benchmarks); with ``-p engine=static``
    the CPU runs the engine, and batches."""
    import rolecall.eval.runner as ev

    prompts = str(tiny_folder / "prompts.jsonl")
    out = tiny_folder / "batched.json"
    assert main(["eval", "--model", str(tiny_folder), "--policy", "full", "--prompts", prompts, "--device", "cpu",
                 "-p", "engine=static", "--batch-size", "2", "--max-new-tokens", "3", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["kv_bytes_per_prompt"] is not None  # the engine ran (it records its cache)
    capsys.readouterr()

    def no_prompts(*args, **kwargs):
        raise AssertionError("prompts built before the refusal")

    monkeypatch.setattr(ev, "suite_prompts", no_prompts)
    for extra, why in ((["--device", "cpu"], "the CPU runs the transformers path"),
                       (["--measure"], "--measure runs the transformers path"),
                       (["-p", "engine=reference"], "-p engine=reference runs the transformers path")):
        code = main(["eval", "--model", str(tiny_folder), "--policy", "full", "--prompts", prompts,
                     "--batch-size", "4", *extra])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.endswith(f"--batch-size 4: {why}, which decodes one prompt at a time; leave "
                                          "--batch-size out or pass 1") and "\n" not in err


def test_paired_difference_closed_form():
    from rolecall.eval import paired_difference

    d = paired_difference([1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0])  # differences 1, 0, 0, 1
    half = 1.959964 * (1 / 3) ** 0.5 / 2  # sample sd √(1/3), n = 4
    assert d["mean"] == 0.5 and d["n"] == 4
    assert d["interval"] == pytest.approx([0.5 - half, 0.5 + half])
    same = paired_difference([0.3, 0.7], [0.3, 0.7])
    assert same["mean"] == 0 and same["interval"] == [0.0, 0.0]
    with pytest.raises(ValueError, match="equally long"):
        paired_difference([1.0], [1.0, 0.0])


def test_eval_with_a_raised_rope_base_records_it_and_refuses_a_bad_one(tiny_folder, capsys):
    code = main(["eval", "--model", str(tiny_folder), "--policy", "full", "--rope-theta", "-5",
                 "--prompts", str(tiny_folder / "prompts.jsonl")])
    assert code == 2 and "--rope-theta must be a positive number, got -5.0" in capsys.readouterr().err
    code = main(["eval", "--model", str(tiny_folder), "--policy", "full", "--rope-theta", "40000",
                 "--prompts", str(tiny_folder / "prompts.jsonl"), "--max-new-tokens", "3", "--json",
                 str(tiny_folder / "rope.json")])
    assert code == 0
    assert json.loads((tiny_folder / "rope.json").read_text())["rope_theta"] == 40000.0


def test_an_evaluation_stopped_midway_resumes_from_its_checkpoint_to_the_same_result(tiny_folder, tmp_path,
                                                                                      monkeypatch):
    """The engine path keeps each finished batch; a run killed in its second batch, its file's last line
    torn, resumes at that batch and gives exactly the uninterrupted result, naming the device of each part
    (the first batch's moved to another). Another run's file is refused."""
    import rolecall.eval.runner as ev

    model, tok, settings, manifest, params = _delta_on_the_engine(tiny_folder)
    whole = evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=2)  # 4 batches

    decode, calls = ev._decode_batch, []

    def stop_at_second(*args, **kwargs):
        calls.append(len(args[3]))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return decode(*args, **kwargs)

    monkeypatch.setattr(ev, "_decode_batch", stop_at_second)
    file = tmp_path / "cell.partial.jsonl"
    with pytest.raises(KeyboardInterrupt):
        evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=2, checkpoint=file)
    header, first = file.read_text().splitlines()  # the header and the first batch, which ran here
    assert json.loads(first)["device"] == "CPU"
    first = json.dumps({**json.loads(first), "device": "NVIDIA H100 80GB HBM3"})  # as if it had run on a GPU
    file.write_text(f"{header}\n{first}\n" + '{"batch": 1, "records": [')  # killed while writing the second
    calls.clear()
    monkeypatch.setattr(ev, "_decode_batch", lambda *a, **k: (calls.append(len(a[3])), decode(*a, **k))[1])
    resumed = evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=2, checkpoint=file)
    assert calls == [2, 2, 2]  # batches 2-4 only
    assert resumed.pop("seconds")["batches"] == whole.pop("seconds")["batches"] == 4  # wall times differ by run
    assert whole.pop("devices") == {"CPU": 4}
    assert "ran on NVIDIA H100 80GB HBM3 (1 batch), CPU (3 batches)" in format_table(resumed)
    assert "ran on" not in format_table(whole)  # one device: no line
    assert resumed.pop("devices") == {"NVIDIA H100 80GB HBM3": 1, "CPU": 3}  # the resumed run names both
    assert json.dumps(resumed, sort_keys=True) == json.dumps(whole, sort_keys=True)
    assert len(file.read_text().splitlines()) == 5
    with pytest.raises(ValueError, match="holds the batches of another run"):
        evaluate(model, tok, manifest, "delta", {**params, "num_pages": 2}, settings, measure=False, batch_size=2,
                 checkpoint=file)


def test_policies_evaluated_together_share_each_batch_prefill(tiny_folder, monkeypatch):
    """evaluate_many on the engine: every batch is prefilled once for all policies (the others load it), and
    each policy's result equals its own evaluation; a measuring job still runs alone."""
    from rolecall.eval import Job, evaluate_many
    from rolecall.runtime.engine import StaticDecoder

    model, tok, settings, manifest, params = _delta_on_the_engine(tiny_folder)
    jobs = [Job("full", None, {"engine": "static"}), Job("delta", manifest, params),
            Job("lethe", None, {"engine": "static", "budget": 12})]
    alone = [evaluate(model, tok, j.manifest, j.policy, j.params, settings, measure=False, batch_size=2) for j in jobs]
    prefill, calls = StaticDecoder.prefill, []
    monkeypatch.setattr(StaticDecoder, "prefill", lambda self, *a, **k: (calls.append(1), prefill(self, *a, **k))[1])
    together = evaluate_many(model, tok, jobs, settings, measure=False, batch_size=2)
    assert len(calls) == 4  # 8 prompts in batches of 2, once each (12 without sharing)
    # each of the 12 sessions viewed the model's projections and gave them back standalone
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    assert all(j.seconds > 0 for j in jobs)
    for a, b in zip(alone, together):
        assert a["policy"] == b["policy"]
        for x, y in zip(a["samples"], b["samples"]):
            assert (x["generated"], x["score"]) == (y["generated"], y["score"])
            assert y["kl_mean"] == pytest.approx(x["kl_mean"], rel=1e-3, abs=1e-6)
        assert b["kv_bytes_per_prompt"] == a["kv_bytes_per_prompt"]
        split = b["seconds"]  # each of the 4 batches timed, its parts inside its wall time
        assert split["batches"] == 4 and split["total"] > 0
        assert all(split[p] >= 0 for p in ("setup", "prefill", "capture", "decode", "reference", "other"))
        parts = sum(split[p] for p in ("setup", "prefill", "capture", "decode", "reference"))
        assert parts <= split["total"] and split["other"] == pytest.approx(split["total"] - parts)
    calls.clear()
    evaluate_many(model, tok, jobs, settings, measure=False, batch_size=2, share_prefill=False)
    assert len(calls) == 12


def test_row_steps_equal_a_slice_of_the_stacked_batch():
    from rolecall.eval import row_steps

    steps = [torch.randn(3, 11, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    stacked = torch.stack(steps, 1)  # [B, N, V]
    for r in range(3):
        for n in (1, 2, 5):
            got = row_steps(steps, r, n)
            assert got.shape == (n - 1, 11) and torch.equal(got, stacked[r, 1:n])


def test_a_batch_generation_is_freed_before_the_next_one_starts(tiny_folder, monkeypatch):
    """At a large vocabulary a batch's step logits are gigabytes (262K × 32 rows × 128 steps: 2 GB in bf16), so
    no earlier generation may still be held, by its session's ``last`` or by a copy, when the next one starts:
    in evaluate_many's shared batches (a new session per policy and batch) and in one session's batches alike.
    Garbage collection is off, so only what nothing references any more counts as freed."""
    import gc
    import weakref

    from rolecall.eval import Job, decoding, evaluate_many

    model, tok, settings, manifest, params = _delta_on_the_engine(tiny_folder)
    made, alive = [], []
    real = decoding.traced_generate

    def watched(*args, **kwargs):
        alive.append(sum(ref() is not None for ref in made))
        out = real(*args, **kwargs)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(decoding, "traced_generate", watched)
    gc.collect()
    gc.disable()
    try:
        evaluate_many(model, tok, [Job("full", None, {"engine": "static"}), Job("delta", manifest, params)], settings,
                      measure=False, batch_size=2)
        evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=2)
    finally:
        gc.enable()
    assert len(alive) == 8 + 4 and alive == [0] * len(alive)


def test_step_logits_the_session_returns_are_views_of_the_engines_buffer():
    """``output_logits=True`` on the engine: one ``[B, V]`` per step as transformers gives them, but views of the
    generation's one buffer (in the model's dtype), not a second copy of it; the evaluation's per-row steps are
    views of it too (no stack of a row's 128 steps at a 262K vocabulary)."""
    from rolecall.eval import policy_steps, row_steps
    from rolecall.runtime import attach

    model = tiny_model("qwen2", layers=2, heads=4, kv_heads=2, head_dim=16)
    ids = torch.randint(3, 250, (2, 40), generator=torch.Generator().manual_seed(0))
    with attach(model, None, "full", engine="static") as session:
        out = session.generate(input_ids=ids, max_new_tokens=6, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        buffer = session.last.step_logits
        assert buffer.shape == (2, 6, model.config.vocab_size) and buffer.dtype == model.dtype
        assert len(out.logits) == 6
        assert all(step.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for step in out.logits)
        assert all(torch.equal(step, buffer[:, k]) for k, step in enumerate(out.logits))
        assert torch.equal(torch.stack(session.last.logits), buffer)  # the per-row views
        for r, n in ((0, 6), (1, 4), (1, 1)):  # what the KL reads: a view of the buffer, equal to the stacked rows
            view = policy_steps(session.last, out.logits, r, n)
            assert torch.equal(view, row_steps(out.logits, r, n)) and view.shape[0] == n - 1
            assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert torch.equal(policy_steps(None, out.logits, 1, 4), row_steps(out.logits, 1, 4))  # off the engine


def test_resume_plan_keeps_the_finished_batches_and_batches_the_rest_afresh():
    from rolecall.eval import resume_plan

    fresh = [[0, 1, 2], [3, 4, 5], [6, 7]]  # batches of 3 of one length each
    assert resume_plan(fresh, [[0, 1], [2, 3]]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert resume_plan(fresh, []) == fresh
    assert resume_plan(fresh, [[0, 1], [2, 3], [4, 5], [6, 7]]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    plan = resume_plan(fresh, [[0, 1]])  # resumed twice with the same size: the same plan
    assert plan == [[0, 1], [2], [3, 4, 5], [6, 7]] and resume_plan(fresh, plan[:2]) == plan


def test_a_run_stopped_midway_resumes_with_another_batch_size(tiny_folder, tmp_path, monkeypatch):
    """Out of memory at batch 2, rerun at batch 3: the finished batch is kept, only the other prompts decode
    (in batches of 3 of one length), and every prompt's generation and score are those of the whole run; a
    further rerun finds everything done. Decoding together, the batches all policies finished are kept."""
    import rolecall.eval.runner as ev
    from rolecall.eval import Job, evaluate_many

    model, tok, settings, manifest, params = _delta_on_the_engine(tiny_folder)
    whole = evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=2)
    decode, calls = ev._decode_batch, []

    def stop_at(n):
        def run(*args, **kwargs):
            calls.append([s["input_ids"].shape[0] for s in args[3]])
            if len(calls) == n:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return decode(*args, **kwargs)
        return run

    file = tmp_path / "cell.partial.jsonl"
    monkeypatch.setattr(ev, "_decode_batch", stop_at(2))
    with pytest.raises(torch.OutOfMemoryError):
        evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=2, checkpoint=file)
    calls.clear()
    monkeypatch.setattr(ev, "_decode_batch", stop_at(0))
    resumed = evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=3, checkpoint=file)
    samples = ev.suite_prompts(tok, settings)
    two, three = (ev._batches(samples, n, settings.max_new_tokens) for n in (2, 3))
    plan = json.loads(file.read_text().splitlines()[0])["batches"]
    assert plan[0] == two[0] and plan[0] not in three  # the finished batch of 2, then the rest by 3
    assert plan == ev.resume_plan(three, [two[0]]) and sorted(i for b in plan for i in b) == list(range(8))
    assert [len(c) for c in calls] == [len(b) for b in plan[1:]] and max(map(len, plan)) == 3
    for x, y in zip(whole["samples"], resumed["samples"]):
        assert (x["generated"], x["score"]) == (y["generated"], y["score"])
        assert y["kl_mean"] == pytest.approx(x["kl_mean"], rel=1e-3, abs=1e-6)
    calls.clear()
    again = evaluate(model, tok, manifest, "delta", params, settings, measure=False, batch_size=3, checkpoint=file)
    assert calls == [] and again["samples"] == resumed["samples"]

    # together: full finished batches 0 and 1 (of 2), delta only batch 0 when the run stopped
    files = [tmp_path / "full.partial.jsonl", tmp_path / "delta.partial.jsonl"]
    jobs = [Job("full", None, {"engine": "static"}, files[0]), Job("delta", manifest, params, files[1])]
    calls.clear()
    monkeypatch.setattr(ev, "_decode_batch", stop_at(4))
    with pytest.raises(torch.OutOfMemoryError):
        evaluate_many(model, tok, jobs, settings, measure=False, batch_size=2)
    calls.clear()
    monkeypatch.setattr(ev, "_decode_batch", stop_at(0))
    results = evaluate_many(model, tok, jobs, settings, measure=False, batch_size=3)
    assert [len(c) for c in calls] == [len(b) for b in plan[1:] for _ in jobs]  # batch 0 kept by both policies
    assert [json.loads(f.read_text().splitlines()[0])["batches"] for f in files] == [plan, plan]
    for x, y in zip(whole["samples"], results[1]["samples"]):
        assert (x["generated"], x["score"]) == (y["generated"], y["score"])
