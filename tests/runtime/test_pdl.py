"""Programmatic dependent launch: where it is on, and a graph-captured step that uses it computes the same bytes
as one that does not (a kernel reading its predecessor's output before that one finished would not)."""

import pytest
import torch

from benchmarks import decode as bench
from rolecall.runtime.engine import ModelShape, StaticDecoder, Weights
from rolecall.runtime.kernels import pdl


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


STEP_CONSTANT = {"IROWS", "OHEADS", "ORDER", "HQ", "HKV"}  # head maps made once per decoder, and constants


def test_every_kernel_that_takes_part_waits_first_thing():
    """The waits chain only if each kernel launched with the flag waits before anything else it does (a program
    that read first, or left without waiting, could see an unfinished predecessor's output, or let a later kernel
    start before that predecessor finished). Saying that the next kernel may be placed may come first: that
    kernel still waits for this one to complete, which this one does only after its own wait. Before its wait a
    kernel may work out its indices and read the head maps, which no kernel of a step writes (:data:`STEP_CONSTANT`),
    and nothing else: no other read, no write, no return."""
    import ast
    import importlib
    import inspect
    import textwrap

    kernels = {}
    for op in ("sparse_attention", "page_scores", "rope_cache", "skinny_linear", "topk_select", "page_bounds",
               "add_rms_norm"):
        module = importlib.import_module(f"rolecall.runtime.kernels.{op}.triton")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)  # a @triton.jit function, compiled or interpreted
            if inspect.isfunction(fn) and "PDL" in inspect.signature(fn).parameters:
                kernels[f"{op}.{name}"] = obj
    assert {"sparse_attention._sparse_decode_partial", "sparse_attention._combine", "rope_cache._rope_store",
            "skinny_linear._skinny_linear", "skinny_linear._split_linear", "topk_select._topk_recent",
            "topk_select._topk_recent_parts", "page_scores._pages_from_logits", "add_rms_norm._add_rms_norm"} <= set(kernels)
    for name, kernel in kernels.items():
        body = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # the docstring
            body = body[1:]
        if ast.unparse(body[0]) == "pdl.let_next_start(PDL)":
            body = body[1:]
        waits = [i for i, st in enumerate(body) if ast.unparse(st) == "pdl.wait(PDL)"]
        assert waits, f"{name} does not wait"
        for node in (n for st in body[:waits[0]] for n in ast.walk(st)):
            assert not isinstance(node, ast.Return), f"{name} may leave before it waits"
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("tl.load", "tl.store", "tl.atomic_add"):
                base = {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name) and n.id.isupper()}
                assert ast.unparse(node.func) == "tl.load" and base <= STEP_CONSTANT, \
                    f"{name} touches {ast.unparse(node.args[0])} before it waits"
