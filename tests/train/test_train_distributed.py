"""train-heads over two processes (gloo on the CPU) computes what one process computes with the same global
batch, and a checkpoint written by two processes resumes in one."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from rolecall import train
from rolecall.core import distributed
from rolecall.core.manifest import RoleManifest
from tests.tiny import tiny_tokenizer
from tests.train.test_train_recipe import _config, _dataset, _model


def _worker(rank: int, world: int, port: int, folder: str, steps: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        assert distributed.world_size() == world and distributed.rank() == rank
        train.run(_model(), tiny_tokenizer(), _dataset(n=5), _cfg(folder, steps))
    finally:
        dist.destroy_process_group()


def _cfg(folder, steps, **kw):
    from pathlib import Path

    return _config(Path(folder), batch_size=2, steps=steps, checkpoint_every=2, target=1, lr=0.1, lambda_lr=0.5, **kw)


def _log(folder):
    return [json.loads(line) for line in (folder / "heads.log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    mp.spawn(_worker, args=(2, 29400 + os.getpid() % 1000, str(two), 4), nprocs=2, join=True)
    torch.set_num_threads(1)
    train.run(_model(), tiny_tokenizer(), _dataset(n=5), _cfg(one, 4))
    return one, two


def test_two_processes_match_one_with_the_same_global_batch(runs):
    one, two = runs
    a, b = _log(one), _log(two)
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b):
        assert ra["sample"] == rb["sample"] and len(ra["sample"]) == 2  # the same two samples per step
        assert rb["distill_loss"] == pytest.approx(ra["distill_loss"], rel=1e-5)
        assert rb["expected_l0"] == pytest.approx(ra["expected_l0"], rel=1e-5)
        assert rb["lambda"] == pytest.approx(ra["lambda"], rel=1e-5)
        assert rb["expected_gate"] == pytest.approx(ra["expected_gate"], abs=1e-5)
    assert a[-1]["expected_gate"] != a[0]["expected_gate"]  # the gates did move
    ma, mb = RoleManifest.load(one / "heads.safetensors"), RoleManifest.load(two / "heads.safetensors")
    assert torch.equal(ma.head_role, mb.head_role)
    torch.testing.assert_close(mb.head_expected_gate, ma.head_expected_gate, atol=1e-5, rtol=0)


def test_a_two_process_checkpoint_resumes_in_one_process(runs, tmp_path):
    one, two = runs
    ckpt = two / "heads.ckpt" / "step-0000002.pt"
    assert ckpt.is_file()
    import shutil

    shutil.copytree(two / "heads.ckpt", tmp_path / "heads.ckpt")
    shutil.copy(two / "heads.log.jsonl", tmp_path / "heads.log.jsonl")
    train.run(_model(), tiny_tokenizer(), _dataset(n=5), _cfg(tmp_path, 4), resume=tmp_path / "heads.ckpt" / ckpt.name)
    resumed, full = _log(tmp_path), _log(one)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for ra, rb in zip(full[2:], resumed[2:]):
        assert rb["distill_loss"] == pytest.approx(ra["distill_loss"], rel=1e-5)
        assert rb["expected_gate"] == pytest.approx(ra["expected_gate"], abs=1e-5)


def test_a_batch_that_does_not_split_over_the_processes_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(distributed, "world_size", lambda: 3)
    with pytest.raises(ValueError, match="batch_size 2 does not split evenly over 3 processes; use a multiple of 3"):
        train.run(_model(), tiny_tokenizer(), _dataset(n=2), _cfg(tmp_path, 1))


def test_frozen_model_deepspeed_config_fills_autos_and_refuses_stages_that_do_not_shard():
    for name in ("zero3", "zero3_offload"):
        cfg = distributed.frozen_model_config(distributed.read_deepspeed_config(name), torch.bfloat16)
        assert cfg["zero_optimization"]["stage"] == 3 and cfg["bf16"] == {"enabled": True}
        assert cfg["train_micro_batch_size_per_gpu"] == 1 and "optimizer" not in cfg
        assert "auto" not in json.dumps(cfg)
    with pytest.raises(ValueError, match="ZeRO stage 2 does not shard a frozen model"):
        distributed.frozen_model_config(distributed.read_deepspeed_config("zero2"), torch.bfloat16)
    with pytest.raises(ValueError, match="no such file, and not one of configs/deepspeed/"):
        distributed.read_deepspeed_config("zero9")


def test_accelerate_environment_selects_the_deepspeed_file(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert distributed.deepspeed_config_from_environment() is None
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(distributed.shipped_deepspeed_configs()["zero3"]))
    assert distributed.zero_stage(distributed.deepspeed_config_from_environment()) == 3
