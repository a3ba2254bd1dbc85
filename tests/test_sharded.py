"""A model built already sharded (DeepSpeed ZeRO-3 over two gloo processes on the CPU, random weights drawn
layer by layer as it is built) holds only its share of each weight, draws them as the architecture's own
initialisation does, and trains heads and calibrates layers to what one unsharded process computes from the
same weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rolecall import calibrate, train
from rolecall.core import distributed
from rolecall.core.manifest import RoleManifest
from tests.tiny import tiny_config
from tests.train.test_train_recipe import _config, _dataset

ZERO3 = {"zero_optimization": {"stage": 3}}
STEPS = 3


def _traces() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (300, 170, 260)]  # uneven: 2 and 1 per process


def _calibration() -> dict:
    return dict(min_context=64, stride=8, chunk_size=128, num_pages=4, recent_pages=1, page_size=8, warmup=1,
                num_delta=2, min_gap=1, plots=False)


def _train_config(folder: Path):
    return _config(folder, batch_size=2, steps=STEPS, checkpoint_every=STEPS, target=2, lr=0.1, lambda_lr=0.5,
                   prefill_chunk=20)


def _worker(rank: int, world: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        out = Path(folder)
        model = distributed.load_frozen_model(str(out / "config.json"), dtype="float32", random_weights=True,
                                              deepspeed=ZERO3, device="cpu")
        assert distributed.is_sharded(model)
        held = {n: [p.numel(), p.ds_numel] for n, p in model.named_parameters()}
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        manifest = calibrate.run(model, None, _traces(), _calibration(), progress=False)
        train.run(model, None, _dataset(n=4), _train_config(out / "train"))
        if rank == 0:
            torch.save(weights, out / "weights.pt")
            manifest.save(out / "delta.safetensors")
        (out / f"held{rank}.json").write_text(json.dumps(held))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    config = tiny_config("qwen2", layers=3, heads=4, kv_heads=2)
    for folder in (one, two):
        config.save_pretrained(folder)
    mp.spawn(_worker, args=(2, 29700 + os.getpid() % 200, str(two)), nprocs=2, join=True)
    torch.set_num_threads(1)
    model = distributed.load_frozen_model(str(one / "config.json"), dtype="float32", random_weights=True, device="cpu")
    model.load_state_dict(torch.load(two / "weights.pt"))  # the weights the sharded build drew, whole
    calibrate.run(model, None, _traces(), _calibration(), progress=False).save(one / "delta.safetensors")
    train.run(model, None, _dataset(n=4), _train_config(one / "train"))
    return one, two, model


def test_each_process_holds_only_its_share_of_every_weight(runs):
    _, two, model = runs
    for rank in (0, 1):
        held = json.loads((two / f"held{rank}.json").read_text())
        assert set(held) == {n for n, _ in model.named_parameters()}
        for name, (local, whole) in held.items():
            assert whole == dict(model.named_parameters())[name].numel()
            assert local <= -(-whole // 2), f"{name}: {local} of {whole} elements on one process"


def test_the_sharded_build_draws_the_architectures_initialisation(runs):
    _, two, model = runs
    gathered, std = torch.load(two / "weights.pt"), model.config.initializer_range
    for name, w in gathered.items():
        if name.endswith("norm.weight"):
            assert torch.equal(w, torch.ones_like(w)), name
        elif name.endswith("bias"):
            assert torch.equal(w, torch.zeros_like(w)), name
        else:  # normal(0, initializer_range): the sample's spread within a few percent
            assert abs(float(w.std()) / std - 1) < 0.1 and abs(float(w.mean())) < 0.1 * std, name
    assert len({float(w.flatten()[0]) for n, w in gathered.items() if n.endswith("proj.weight")}) > 1  # not one copy


def test_sharded_training_and_calibration_match_one_unsharded_process(runs):
    one, two, _ = runs
    logs = [[json.loads(line) for line in (d / "train" / "heads.log.jsonl").read_text().splitlines()] for d in (one, two)]
    assert len(logs[0]) == len(logs[1]) == STEPS
    for a, b in zip(*logs):
        assert a["sample"] == b["sample"]
        assert b["distill_loss"] == pytest.approx(a["distill_loss"], rel=1e-4)
        assert b["expected_gate"] == pytest.approx(a["expected_gate"], abs=1e-4)
    assert logs[1][-1]["expected_gate"] != logs[1][0]["expected_gate"]  # the gates moved
    ma, mb = RoleManifest.load(one / "delta.safetensors"), RoleManifest.load(two / "delta.safetensors")
    assert ma.metrics["delta_layers"] == mb.metrics["delta_layers"]
    assert mb.data["traces"] == 3 and mb.metrics["sampled_queries"] == ma.metrics["sampled_queries"] > 0
    torch.testing.assert_close(mb.layer_shift, ma.layer_shift, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mb.layer_sparsity, ma.layer_sparsity, rtol=1e-4, atol=1e-5)


def test_a_device_map_build_allocates_each_placed_module_and_draws_it_there():
    config = tiny_config("llama", layers=2, heads=4, kv_heads=2)
    placement = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu", "model.norm": "cpu",
                 "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = distributed.random_model(config, torch.float32, device_map=placement)
    whole = distributed.random_model(config, torch.float32, device="cpu")
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    # the rotary frequencies are recomputed, not left as the meta build's empty storage
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, whole.model.rotary_emb.inv_freq, rtol=0, atol=0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(float(p.detach().std()) / config.initializer_range - 1) < 0.15, name
    ids = torch.randint(0, 256, (1, 12))
    assert torch.isfinite(model(ids).logits).all()
