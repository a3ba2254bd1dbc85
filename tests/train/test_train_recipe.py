import json

import pytest
import torch

from rolecall import train
from rolecall.core.manifest import RoleManifest
from rolecall.train.checkpoint import CheckpointError, checkpoint_path
from rolecall.train.config import TrainConfig, build_config, read_yaml, shipped_configs
from rolecall.train.distill import NotFiniteError
from rolecall.train.outputs import head_roles
from rolecall.train.recipe import sample_index
from tests.tiny import tiny_model, tiny_tokenizer

LAYERS, KV = 3, 2


def _dataset(n=3, length=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        ids = torch.randint(0, 256, (length,), generator=g)
        labels = torch.full_like(ids, -100)
        labels[length - 14 : length - 9] = ids[length - 14 : length - 9]
        labels[length - 5 :] = ids[length - 5 :]
        items.append({"input_ids": ids, "labels": labels})
    return items


def _model():
    return tiny_model("qwen2", layers=LAYERS, heads=4, kv_heads=KV)


def _config(tmp_path, **kw):
    base = dict(model="tiny", target=2, steps=6, checkpoint_every=3, prefill_chunk=20, lr=0.05, lambda_lr=0.05,
                output=str(tmp_path / "heads.safetensors"), plots=False)
    base.update(kw)
    return TrainConfig(**base)


def test_every_shipped_yaml_is_a_valid_config():
    shipped = shipped_configs()
    assert {"llama3-8b-1048k", "smollm2-135m", "llama3-8b-1048k.hardconcrete", "llama3-8b-1048k.sigmoid"} <= set(shipped)
    for name in shipped:
        cfg = build_config(name)
        assert set(read_yaml(name)) <= set(cfg.to_dict())
        assert cfg.model == name.split(".")[0] or name.startswith(f"{cfg.model}.")  # the model the file is named for
    paper = build_config("llama3-8b-1048k")
    assert (paper.steps, paper.lr, paper.target, paper.token_budget, paper.low, paper.high) == (3000, 0.01, 32, 0.3, -0.1, 1.1)


def test_model_alias_picks_its_default_config_and_no_variant(capsys):
    """``--model llama3-8b-1048k`` alone reads the paper's recipe, as ``--model smollm2-135m`` reads its file;
    the variants (``llama3-8b-1048k.<gate>``) are read only when named."""
    paper = build_config(None, model="llama3-8b-1048k")
    assert paper == build_config("llama3-8b-1048k")
    assert (paper.model, paper.gate, paper.lambda_lr, paper.mixed_precision) == ("llama3-8b-1048k", "hardkuma", 8.0, "bf16")
    assert build_config(None, model="smollm2-135m") == build_config("smollm2-135m")
    assert build_config("llama3-8b-1048k.sigmoid").gate == "sigmoid"
    assert build_config("llama3-8b-1048k.hardconcrete", model="llama3-8b-1048k").gate == "hardconcrete"
    assert build_config(None, model="qwen-7b") == TrainConfig(model="qwen-7b")  # no file: the defaults
    assert capsys.readouterr().err == ""  # current names say nothing


def test_config_layers_and_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 7\nlr: 0.5\ntoken_budget: 64\n")
    cfg = build_config(str(path), lr=0.2, model="x")
    assert (cfg.steps, cfg.lr, cfg.token_budget, cfg.target) == (7, 0.2, 64, 32)
    assert build_config(None, model="smollm2-135m").lengths == tuple(read_yaml("smollm2-135m")["lengths"])
    path.write_text("stepz: 7\n")
    with pytest.raises(ValueError, match="unknown option.*stepz"):
        build_config(str(path))
    with pytest.raises(ValueError, match="no such file, and not one of configs/train"):
        build_config("nope")
    with pytest.raises(ValueError, match="token_budget"):
        TrainConfig(token_budget=1.5)
    with pytest.raises(ValueError, match="gate 'kuma' is unknown"):
        TrainConfig(gate="kuma")


def test_data_order_visits_every_sample_once_per_epoch():
    order = [sample_index(s, 5, seed=3) for s in range(10)]
    assert sorted(order[:5]) == list(range(5)) and sorted(order[5:]) == list(range(5))
    assert order != [sample_index(s, 5, seed=4) for s in range(10)]


def test_exact_target_roles():
    ez = torch.tensor([[0.9, 0.2], [0.6, 0.6], [0.1, 0.7]])
    assert head_roles(ez, 2, exact=False).tolist() == [[1, 0], [1, 1], [0, 1]]
    assert head_roles(ez, 2, exact=True).tolist() == [[1, 0], [0, 0], [0, 1]]
    assert int(head_roles(ez, 3, exact=True).sum()) == 3


def test_a_gate_at_exactly_one_half_is_not_retrieval():
    # "E[z] > 0.5": a Sigmoid gate at its initial logit 0 has z = −0.1 + 1.2 · σ(0) = 0.5 exactly, undecided
    ez = torch.tensor([[0.5, 0.5000001], [0.4999999, 1.0]])
    assert head_roles(ez, 2, exact=False).tolist() == [[0, 1], [0, 1]]


def test_run_writes_a_manifest_and_resume_reproduces_it_exactly(tmp_path):
    model, ds = _model(), _dataset()
    flags = [p.requires_grad for p in model.parameters()]
    cfg = _config(tmp_path, plots=True)
    manifest = train.run(model, tiny_tokenizer(), ds, cfg)
    out = tmp_path / "heads.safetensors"
    first = out.read_bytes()
    loaded = RoleManifest.load(out)
    loaded.validate_for(model)
    assert loaded.equals(manifest)
    assert loaded.head_role[0].tolist() == [1] * KV and loaded.head_expected_gate[0].tolist() == [1.0] * KV
    assert loaded.head_role.shape == (LAYERS, KV) and loaded.metrics["steps"] == 6
    assert loaded.config["target"] == 2 and loaded.data["num_samples"] == 3 and len(loaded.data["sha256"]) == 64
    for key in ("final_loss", "expected_l0", "lambda", "fraction_undecided"):
        assert key in loaded.metrics
    ez = loaded.head_expected_gate[1:]
    assert loaded.head_role[1:].tolist() == (ez > 0.5).to(torch.int8).tolist()
    log = [json.loads(line) for line in (tmp_path / "heads.log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(6))
    assert log[-1]["expected_gate"] == pytest.approx(ez.flatten().tolist(), abs=1e-6)
    assert (tmp_path / "heads.gates.png").stat().st_size > 1000 and (tmp_path / "heads.curves.png").stat().st_size > 1000
    assert json.loads((tmp_path / "heads.config.json").read_text())["steps"] == 6
    # the model is exactly as before
    assert [p.requires_grad for p in model.parameters()] == flags
    assert model.config._attn_implementation == "sdpa"
    # resuming from the step-3 checkpoint gives the same bytes
    out.unlink()
    train.run(model, tiny_tokenizer(), ds, cfg, resume=checkpoint_path(out, 3))
    assert out.read_bytes() == first
    assert [json.loads(line)["step"] for line in (tmp_path / "heads.log.jsonl").read_text().splitlines()] == list(range(6))
    with pytest.raises(CheckpointError, match="target is 2 in the checkpoint but 3 now"):
        train.run(model, tiny_tokenizer(), ds, _config(tmp_path, target=3), resume="latest")
    with pytest.raises(CheckpointError, match="dataset differs"):
        train.run(model, tiny_tokenizer(), _dataset(seed=9), cfg, resume="latest")
    # resuming at the last checkpoint with steps equal to it trains nothing and writes that state
    m3 = train.run(model, tiny_tokenizer(), ds, _config(tmp_path, plots=True, steps=3), resume=checkpoint_path(out, 3))
    assert m3.metrics["steps"] == 3 and m3.metrics["final_loss"] == log[2]["distill_loss"]


@pytest.mark.parametrize("gate", ["hardconcrete", "sigmoid"])
def test_baseline_gates_train_through_the_same_recipe(tmp_path, gate):
    m = train.run(_model(), tiny_tokenizer(), _dataset(n=1), _config(tmp_path, gate=gate, steps=2, exact_target=True))
    assert int(m.head_role[1:].sum()) == 2 and m.metrics["gate"] == gate


def test_multiplier_rises_while_over_target_and_stays_at_zero_otherwise(tmp_path):
    """E[L0] starts at 4 · 11/12 ≈ 3.67. Over target 1, λ grows by lambda_lr · (E[L0] − goal) each step, where
    the goal 1 · (1 − 2p) + 4p = 1.02 is what one open gate and three shut ones count under the default bound
    p = 0.01, and E[L0] falls; with a target of all 4 heads the constraint holds from the start and λ stays 0."""
    model, ds = _model(), _dataset(n=2, length=40)
    m = train.run(model, tiny_tokenizer(), ds, _config(tmp_path, target=1, steps=30, lr=0.1, lambda_lr=0.2,
                                                        checkpoint_every=100))
    goal = 1 * (1 - 2 * 0.01) + 4 * 0.01
    assert m.metrics["expected_l0_goal"] == pytest.approx(goal)
    log = [json.loads(line) for line in (tmp_path / "heads.log.jsonl").read_text().splitlines()]
    assert log[0]["expected_l0"] == pytest.approx(4 * 11 / 12, rel=1e-5)
    assert log[0]["lambda"] == pytest.approx(0.2 * (log[0]["expected_l0"] - goal), rel=1e-6)
    assert log[1]["lambda"] == pytest.approx(log[0]["lambda"] + 0.2 * (log[1]["expected_l0"] - goal), rel=1e-6)
    assert min(r["expected_l0"] for r in log) < 1.5
    m = train.run(model, tiny_tokenizer(), ds, _config(tmp_path, target=4, steps=10, lr=0.1, lambda_lr=0.2),
                  overwrite=True)
    # every gate open sits on the goal 4 (1 − p): λ sees only rounding above it
    assert m.metrics["lambda"] < 1e-6
    log = [json.loads(line) for line in (tmp_path / "heads.log.jsonl").read_text().splitlines()]
    assert all(r["lambda"] < 1e-6 for r in log)
    assert log[-1]["expected_l0"] > log[0]["expected_l0"]  # distillation alone opens gates


def test_multiplier_is_projected_onto_zero_while_under_the_goal(tmp_path):
    """λ ← max(0, λ + lambda_lr · (E[L0] − goal)) from λ = 0: with a target of all 4 heads the goal is
    4 (1 − 2p) + 4p = 3.96 (p = 0.01) and E[L0] starts at 4 · 11/12 ≈ 3.67 below it, so the first step's
    ascent 0.5 · (3.67 − 3.96) < 0 is clipped and λ is exactly 0; it never goes below 0."""
    model, ds = _model(), _dataset(n=1, length=40)
    train.run(model, tiny_tokenizer(), ds, _config(tmp_path, target=4, steps=2, lr=0.1, lambda_lr=0.5,
                                                    checkpoint_every=100))
    log = [json.loads(line) for line in (tmp_path / "heads.log.jsonl").read_text().splitlines()]
    goal = 4 * (1 - 2 * 0.01) + 4 * 0.01
    assert log[0]["expected_l0"] == pytest.approx(4 * 11 / 12, rel=1e-5) and log[0]["expected_l0"] < goal - 0.2
    assert log[0]["lambda"] == 0.0
    assert all(r["lambda"] >= 0.0 for r in log)


def test_non_finite_loss_stops_with_step_and_tensor(tmp_path):
    model = _model()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    # the teacher's logits are named first: the model itself, not the gates, is the cause
    with pytest.raises(NotFiniteError, match=r"step 0: teacher logits holds \d+ non-finite value\(s\) of \d+; the "
                       r"model's own logits are not finite"):
        train.run(model, tiny_tokenizer(), _dataset(n=1), _config(tmp_path))
    # no checkpoint, so nothing is written: no empty heads.ckpt/ to block a rerun, no sidecar without a manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_bad_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="exceeds the 4 gated heads"):
        train.run(_model(), tiny_tokenizer(), _dataset(n=1), _config(tmp_path, target=5))
    with pytest.raises(ValueError, match="dataset is empty"):
        train.run(_model(), tiny_tokenizer(), [], _config(tmp_path))
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        train.run(_model(), tiny_tokenizer(), _dataset(n=1), _config(tmp_path), resume="latest")
