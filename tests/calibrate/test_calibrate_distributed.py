"""Two processes (gloo, CPU) each record half of the traces; the all-reduced totals equal one pass."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from rolecall.calibrate.api import record
from rolecall.calibrate.config import resolve
from tests.tiny import tiny_model

CONFIG = {"stride": 5, "min_context": 12, "page_size": 4, "num_pages": 2, "recent_pages": 1, "bins": 3,
          "chunk_size": 32}


def traces() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (60, 33, 47)]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        totals = record(tiny_model("llama", layers=2, heads=4, kv_heads=2, seed=9), traces(), resolve(CONFIG),
                        progress=False)
        if rank == 0:
            torch.save(totals.tensors(), out)
    finally:
        dist.destroy_process_group()


def test_two_processes_reduce_to_the_single_process_totals(tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    out = tmp_path / "totals.pt"
    port = 29500 + os.getpid() % 1000
    mp.spawn(_worker, args=(2, port, str(out)), nprocs=2, join=True)
    reduced = torch.load(out)
    # one thread, as in the workers: a float32 product may round differently when it is split over threads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = record(tiny_model("llama", layers=2, heads=4, kv_heads=2, seed=9), traces(), resolve(CONFIG),
                        progress=False)
    finally:
        torch.set_num_threads(threads)
    for key, value in single.tensors().items():
        torch.testing.assert_close(reduced[key], value, rtol=1e-12, atol=1e-12, msg=key)
    assert single.traces.item() == 3 and single.recall_count.item() > 0
