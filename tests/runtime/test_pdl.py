"""Programmatic dependent launch: where it is on, and a graph-captured step that uses it computes the same bytes
as one that does not (a kernel reading its predecessor's output before that one finished would not)."""

import pytest
import torch

from benchmarks import decode as bench
from runtime.engine import ModelShape, StaticDecoder, Weights
from runtime.kernels import pdl


def test_on_only_where_supported_and_not_switched_off(monkeypatch):
    assert pdl.options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    cuda = torch.device("cuda", 0)
    assert pdl.options(cuda) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("ROLECALL_PDL", "0")
    assert pdl.options(cuda) == {"PDL": False}
    monkeypatch.setattr(pdl, "_supported", lambda index: False)
    monkeypatch.delenv("ROLECALL_PDL")
    assert pdl.options(cuda) == {"PDL": False}


SHAPE = ModelShape(layers=4, hidden=512, heads=8, kv_heads=2, head_dim=128, intermediate=1024, vocab=1000)


@pytest.mark.gpu
@pytest.mark.parametrize("name,batch", [("full", 3), ("delta", 8), ("lychee", 3), ("lychee", 8)])
def test_a_step_with_dependent_launches_equals_one_without_on_gpu(monkeypatch, name, batch):
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0 (Hopper) or later")
    weights = Weights.random(SHAPE, "cuda", torch.bfloat16, std=0.05, positions=4096)
    decs = []
    for switch in ("1", "0"):  # the launches are fixed when the graph is captured
        monkeypatch.setenv("ROLECALL_PDL", switch)
        dec = StaticDecoder(weights, bench.make_policy(name, SHAPE, 256, 5), batch, 3000, min_context=0)
        dec.cache.fill_random(seed=1)
        dec.set_length(2500)
        dec.capture()
        decs.append(dec)
    with_pdl, without = decs
    for t in torch.randint(0, SHAPE.vocab, (8, batch), device="cuda"):
        assert torch.equal(with_pdl.step(t).clone(), without.step(t).clone())
    assert torch.equal(with_pdl.cache.k[3], without.cache.k[3])
