"""rolecall tune: the choice against hand-worked frontiers, refusals, resuming, the written manifest, and the
commands and attach() taking the recommended setting up."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rolecall.cli import build_parser, main
from rolecall.core.manifest import ManifestError, ModelIdentity, RoleManifest
from rolecall.eval import tune as tuning
from rolecall.eval.tune import Candidate, TuneSettings, candidates, choose
from tests.tiny import tiny_config, tiny_folder, tiny_model

SHAPE = dict(layers=4, heads=4, kv_heads=2)


def row(name: str, policy: str, difference: float, low: float, tpot: float | None, read: float) -> dict:
    return {"name": name, "policy": policy, "params": {}, "score": 1 + difference / 100, "difference": difference,
            "interval": [low, 2 * difference - low], "n": 10, "attended_fraction": read, "tpot_ms": tpot}


FRONTIER = [row("full", "full", 0.0, 0.0, 10.0, 1.0),
            row("delta budget=64", "delta", -10.0, -29.6, 3.0, 0.1),
            row("delta budget=128", "delta", 0.0, 0.0, 4.0, 0.3),
            row("quest budget=64", "quest", 0.0, 0.0, 5.0, 0.2),
            row("quest budget=32", "quest", -0.5, -0.9, 6.0, 0.15)]


def test_a_budget_in_deltas_parameters_counts_a_partial_page():
    from rolecall.eval.budgets import policy_params
    from rolecall.runtime.policies import get_policy

    # 1020 tokens are 63.75 pages: K = 64 (the partial page counts), L = 64 // 8 = 8 (the paper's L/K = 8/64)
    params = policy_params("delta", 1020)
    assert params == {"budget": 1020, "page_size": 16, "recent_pages": 8}
    assert get_policy("delta", **params).num_pages == 64


@pytest.mark.parametrize(("max_drop", "cost", "expected"), [
    (1.0, "tpot", "delta budget=128"),  # delta 64 is faster but may lose 29.6 points
    (1.0, "keys", "quest budget=32"),  # its lower end, -0.9, is inside a drop of 1
    (0.5, "keys", "quest budget=64"),  # ... and outside a drop of 0.5
    (40.0, "tpot", "delta budget=64"),
    (40.0, "keys", "delta budget=64"),
])
def test_the_cheapest_setting_within_the_drop_is_chosen(max_drop, cost, expected):
    chosen, closest = choose(FRONTIER, max_drop, cost)
    assert chosen["name"] == expected and closest is None


def test_full_attention_when_no_sparse_setting_qualifies_and_the_closest_is_named():
    rows = [FRONTIER[0], FRONTIER[1], row("quest budget=32", "quest", -3.0, -8.0, 6.0, 0.15)]
    chosen, closest = choose(rows, 1.0, "tpot")
    assert chosen["name"] == "full" and closest["name"] == "quest budget=32"  # -8.0 is the highest lower end


def test_a_tie_in_cost_goes_to_full_attention_then_to_the_higher_score():
    rows = [row("full", "full", 0.0, 0.0, 5.0, 1.0), row("delta budget=4096", "delta", 0.0, 0.0, 5.0, 1.0)]
    assert choose(rows, 1.0, "keys")[0]["name"] == "full"
    rows = [FRONTIER[0], row("b", "quest", -0.2, -0.5, 2.0, 0.2), row("a", "delta", 0.0, -0.4, 2.0, 0.2)]
    assert choose(rows, 1.0, "tpot")[0]["name"] == "a"
    rows[2]["difference"] = -0.3  # a lower score: b's is higher
    assert choose(rows, 1.0, "tpot")[0]["name"] == "b"


def test_an_untimed_setting_is_never_the_cheapest_by_tpot():
    rows = [FRONTIER[0], row("delta budget=64", "delta", 0.0, 0.0, None, 0.1)]
    assert choose(rows, 1.0, "tpot")[0]["name"] == "full"
    assert choose(rows, 1.0, "keys")[0]["name"] == "delta budget=64"


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, math.nan, math.inf])
def test_a_max_drop_that_is_not_above_zero_is_refused(bad):
    with pytest.raises(ValueError, match="max_drop"):
        TuneSettings(max_drop=bad)


def test_candidates_follow_the_manifest_sections_and_refuse_what_it_lacks():
    found = candidates(["layers"], None, (1024, 512), (1, 4))
    assert [c.name for c in found] == ["full", "delta budget=512", "delta budget=512 refine=4", "delta budget=1024",
                                       "delta budget=1024 refine=4", "quest budget=512", "quest budget=1024"]
    assert found[2].params == {"budget": 512, "page_size": 16, "recent_pages": 4, "refine": 4}  # K = 32, L = K / 8
    assert [c.policy for c in candidates(["layers", "heads"], None, (64,))] == ["full", "delta", "lychee", "quest"]
    with pytest.raises(ValueError, match="lychee needs a manifest with a heads section"):
        candidates(["layers"], ("lychee",), (64,))
    with pytest.raises(ValueError, match="rolecall tune tries"):
        candidates(["layers"], ("vattention",), (64,))
    with pytest.raises(ValueError, match="budgets"):
        candidates(["layers"], None, (0,))


# -- the command on a tiny model --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model folder, a layers + heads manifest of it and ten prompts with answers."""
    root = tmp_path_factory.mktemp("tune")
    tiny_folder(root / "model", "qwen2", **SHAPE)
    config = tiny_config("qwen2", **SHAPE)
    RoleManifest(ModelIdentity.from_config(config, name="tiny"), layer_role=[0, 1, 2, 2],
                 head_role=torch.tensor([[1, 1], [0, 1], [1, 0], [0, 0]], dtype=torch.int8)).save(root / "m.safetensors")
    rows = [{"prompt": f"record {i}: " + "the quick brown fox jumps over the lazy dog " * 2, "answer": f"a{i}"}
            for i in range(10)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


# planted per-prompt scores (of 10 prompts), shares read and TPOT for each candidate
PLANTED = {"full": ([1] * 10, 1.0, 10.0), "delta budget=64": ([1] * 9 + [0], 0.1, 3.0),
           "delta budget=128": ([1] * 10, 0.3, 4.0), "quest budget=64": ([1] * 10, 0.2, 5.0),
           "quest budget=128": ([1] * 10, 0.4, 7.0)}


class Planted:
    """evaluate_many and time_candidate with planted results; counts the calls."""

    def __init__(self, monkeypatch, stop_at: int | None = None):
        import rolecall.eval.runner

        self.scored, self.timed, self.stop_at = [], [], stop_at
        monkeypatch.setattr(rolecall.eval.runner, "evaluate_many", self.evaluate_many)
        monkeypatch.setattr(tuning, "time_candidate", self.time_candidate)

    def evaluate_many(self, model, tokenizer, jobs, settings, samples, measure=None, batch_size=None):
        assert not measure and all(job.params["engine"] == "static" for job in jobs)
        out = []
        for job in jobs:
            name = Candidate(job.policy, job.params.get("budget")).name
            self.scored.append(name)
            scores, read, _ = PLANTED[name]
            assert len(samples) == len(scores)
            out.append({"samples": [{"score": float(s)} for s in scores], "attended_fraction": read})
        return out

    def time_candidate(self, model, manifest, candidate, batch, context, new_tokens):
        if self.stop_at is not None and len(self.timed) == self.stop_at:
            raise KeyboardInterrupt  # the run is killed here
        self.timed.append(candidate.name)
        return PLANTED[candidate.name][2]


def tune_args(tiny, out, *extra):
    return ["tune", "--model", str(tiny / "model"), "--manifest", str(tiny / "m.safetensors"), "--prompts",
            str(tiny / "prompts.jsonl"), "--policies", "delta,quest", "--budgets", "64,128", "--refine", "1",
            "--max-new-tokens", "4", "--out", str(out), *extra]


def test_tune_writes_the_cheapest_setting_of_a_planted_frontier(tiny, tmp_path, monkeypatch, capsys):
    planted = Planted(monkeypatch)
    assert main(tune_args(tiny, tmp_path / "run")) == 0
    assert sorted(planted.scored) == sorted(PLANTED) and sorted(planted.timed) == sorted(PLANTED)
    out = capsys.readouterr().out
    assert "recommended: delta budget=128 (cheapest by tpot within 1 points)" in out
    tuned = RoleManifest.load(tmp_path / "run" / "manifest.safetensors")  # its content hash verified
    assert tuned.recommended["policy"] == "delta"
    assert tuned.recommended["params"] == {"budget": 128, "page_size": 16, "recent_pages": 1}
    e = tuned.recommended["evidence"]
    assert (e["difference"], e["interval"], e["n"], e["tpot_ms"], e["full_tpot_ms"]) == (0.0, [0.0, 0.0], 10, 4.0, 10.0)
    assert e["prompts_file"] == "prompts.jsonl" and "/" not in e["command"].replace("--max-drop", "")
    given = RoleManifest.load(tiny / "m.safetensors")
    assert tuned.delta_layers == given.delta_layers and tuned.retrieval_heads == given.retrieval_heads
    assert (tmp_path / "run" / "frontier.png").read_bytes()[:4] == b"\x89PNG"

    # the same run again: nothing decodes or is timed, and the manifest is the same bytes
    first = (tmp_path / "run" / "manifest.safetensors").read_bytes()
    planted.scored.clear(), planted.timed.clear()
    assert main(tune_args(tiny, tmp_path / "run")) == 0
    assert planted.scored == planted.timed == []
    assert (tmp_path / "run" / "manifest.safetensors").read_bytes() == first

    # another drop or cost is a new choice over the same evidence: delta 64's lower end is -29.6
    sd = math.sqrt((9 * 10**2 + 90**2) / 9)
    assert main(tune_args(tiny, tmp_path / "run", "--max-drop", "40")) == 0
    e = RoleManifest.load(tmp_path / "run" / "manifest.safetensors").recommended["evidence"]
    assert e["difference"] == pytest.approx(-10.0) and e["interval"][0] == pytest.approx(-10 - 1.959964 * sd / 10**0.5)
    assert main(tune_args(tiny, tmp_path / "run", "--cost", "keys")) == 0
    assert RoleManifest.load(tmp_path / "run" / "manifest.safetensors").recommended["params"]["budget"] == 64
    assert RoleManifest.load(tmp_path / "run" / "manifest.safetensors").recommended["policy"] == "quest"
    assert planted.scored == []


def test_tune_resumes_after_a_kill(tiny, tmp_path, monkeypatch, capsys):
    Planted(monkeypatch)
    assert main(tune_args(tiny, tmp_path / "whole")) == 0
    killed = Planted(monkeypatch, stop_at=2)
    with pytest.raises(KeyboardInterrupt):
        main(tune_args(tiny, tmp_path / "run"))
    assert len(killed.scored) == 5 and len(killed.timed) == 2
    assert not (tmp_path / "run" / "manifest.safetensors").exists()
    resumed = Planted(monkeypatch)
    assert main(tune_args(tiny, tmp_path / "run")) == 0
    assert resumed.scored == [] and sorted(resumed.timed) == sorted(set(PLANTED) - set(killed.timed))
    assert (tmp_path / "run" / "manifest.safetensors").read_bytes() == \
        (tmp_path / "whole" / "manifest.safetensors").read_bytes()
    # a folder of another run is refused, not mixed in
    assert main(tune_args(tiny, tmp_path / "run", "--batch", "4")) == 2
    assert "holds another tune run (its batch is 1, this run's 4)" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-drop", "0"], "--max-drop 0"),
    (["--max-drop", "-2"], "--max-drop -2"),
    (["--batch", "0"], "--batch 0"),
    (["--policies", "lychee,delta", "--manifest", "LAYERS"], "lychee needs a manifest with a heads section"),
    (["--suite", "reasoning"], "--suite reasoning has no answers"),
    (["--budgets", "0"], "--budgets takes comma-separated token budgets of at least 1"),
])
def test_tune_refuses_bad_flags_in_one_line_before_the_model_loads(tiny, tmp_path, monkeypatch, capsys, flags,
                                                                   message):
    import rolecall.core.models

    monkeypatch.setattr(rolecall.core.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    if "LAYERS" in flags:
        layers = RoleManifest.load(tiny / "m.safetensors")
        layers.head_role = None
        flags[flags.index("LAYERS")] = str(layers.save(tmp_path / "layers.safetensors"))
    args = tune_args(tiny, tmp_path / "run")
    args = [a for i, a in enumerate(args) if not (a == "--policies" or (i and args[i - 1] == "--policies"))]
    try:
        code = main(args + flags)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_tune_end_to_end_on_a_tiny_model(tiny, tmp_path, capsys):
    """Unplanted: full attention against itself differs by exactly 0, and delta at a budget that covers every
    prompt reads all of it, so it scores what full attention scores."""
    args = tune_args(tiny, tmp_path / "run", "--batch", "2", "--time-tokens", "4", "--cost", "keys")
    args[args.index("--budgets") + 1] = "16,4096"
    args[args.index("--policies") + 1] = "delta"
    assert main(args) == 0
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"full", "delta budget=16", "delta budget=4096"}
    assert rows["full"]["difference"] == 0 and rows["full"]["interval"] == [0, 0]
    assert rows["delta budget=4096"]["difference"] == 0 and rows["delta budget=4096"]["interval"] == [0, 0]
    assert rows["delta budget=16"]["attended_fraction"] < 1 and all(r["tpot_ms"] > 0 for r in rows.values())
    tuned = RoleManifest.load(tmp_path / "run" / "manifest.safetensors")
    assert tuned.recommended["policy"] == result["chosen"]["policy"]


# -- the recommended setting in use ------------------------------------------------------------------------------

def recommended_manifest(**recommended) -> RoleManifest:
    config = tiny_config("qwen2", **SHAPE)
    return RoleManifest(ModelIdentity.from_config(config, name="tiny"), layer_role=[0, 1, 2, 2],
                        recommended=recommended)


QUEST = {"policy": "quest", "params": {"budget": 64, "page_size": 16},
         "evidence": {"difference": -0.4, "interval": [-1.2, 0.5], "n": 140}}


def test_attach_takes_the_recommended_setting_when_no_policy_is_named(capsys):
    from rolecall.runtime import attach

    model = tiny_model("qwen2", **SHAPE)
    manifest = recommended_manifest(**QUEST)
    with attach(model, manifest) as session:
        assert session.policy.name == "quest" and session.policy.budget == 64
    err = capsys.readouterr().err.strip()
    assert err == ("rolecall: decoding with quest -p budget=64 -p page_size=16, the manifest's recommended setting "
                   "(-0.4 points [-1.2, +0.5] against full attention over 140 prompts); name a policy to override it")
    with attach(model, manifest, budget=32) as session:  # a parameter given goes over the recommended one
        assert session.policy.name == "quest" and session.policy.budget == 32
    capsys.readouterr()
    with attach(model, manifest, "full") as session:  # a policy named: as named, nothing said
        assert session.policy.name == "full"
    with attach(model, recommended_manifest()) as session:  # no recommendation: delta, as before
        assert session.policy.name == "delta"
    assert capsys.readouterr().err == ""


def test_decode_and_serve_take_the_recommended_setting(tmp_path, capsys):
    from rolecall.cli.common import policy_inputs

    tiny_folder(tmp_path / "model", "qwen2", **SHAPE)
    path = recommended_manifest(**QUEST).save(tmp_path / "tuned.safetensors")
    for command in (["serve"], ["decode", "--prompt", "hi"]):
        args = build_parser(command[0]).parse_args([*command, "--model", str(tmp_path / "model"), "--manifest",
                                                    str(path), "-p", "budget=32"])
        params, _ = policy_inputs(args, tiny_config("qwen2", **SHAPE))
        assert args.policy == "quest" and params == {"budget": 32, "page_size": 16}
        assert "the manifest's recommended setting" in capsys.readouterr().err
    assert main(["decode", "--model", str(tmp_path / "model"), "--manifest", str(path), "--prompt", "hello",
                 "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "decoding with quest -p budget=64 -p page_size=16" in err and "policy quest" in err


def test_the_recommended_setting_round_trips_and_a_malformed_one_is_refused(tmp_path, capsys):
    manifest = recommended_manifest(**QUEST)
    raw = manifest.to_bytes()
    back = RoleManifest.from_bytes(raw)
    assert back.recommended == QUEST and back.to_bytes() == raw
    assert recommended_manifest().to_bytes() != raw  # the recommendation is content: the hash covers it
    for bad in ({"params": {}}, {"policy": "", "params": {}}, {"policy": "delta", "params": [1]}):
        with pytest.raises(ManifestError, match="recommended must be"):
            recommended_manifest(**bad)
    assert main(["inspect", str(manifest.save(tmp_path / "t.safetensors"))]) == 0
    assert ("recommended  quest -p budget=64 -p page_size=16 (-0.4 points [-1.2, +0.5] against full attention "
            "over 140 prompts)") in capsys.readouterr().out


def test_the_hub_card_names_the_recommended_setting_and_the_folder_loads_it(tmp_path):
    from rolecall.core.manifest.hub import export_hub

    manifest = recommended_manifest(**{**QUEST, "evidence": {**QUEST["evidence"], "max_drop": 1.0,
                                                              "command": "rolecall tune --model tiny --suite passkey"}})
    raw = manifest.to_bytes()
    out = export_hub(manifest, raw, tmp_path / "hub", "org/tiny", tiny_config("qwen2", **SHAPE))
    card = (out / "README.md").read_text()
    assert "## Recommended setting" in card and "`quest -p budget=64 -p page_size=16`" in card
    assert "rolecall tune --model tiny --suite passkey" in card and "from rolecall.runtime import attach" in card
    assert RoleManifest.load(out).recommended == manifest.recommended


def test_a_prompt_without_an_answer_is_refused_before_the_model_loads(tiny, tmp_path, monkeypatch, capsys):
    import rolecall.core.models

    monkeypatch.setattr(rolecall.core.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    rows = [{"prompt": "one", "answer": "a"}, {"prompt": "two"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = tune_args(tiny, tmp_path / "run")
    args[args.index("--prompts") + 1] = str(tmp_path / "p.jsonl")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "prompt 2 has no answer to score" in err and "\n" not in err
    assert not (tmp_path / "run").exists()
