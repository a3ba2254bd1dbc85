"""The static decode step: equal to transformers with full attention, to the engine's policies, and to itself
when replayed from a CUDA graph; the byte bounds of the speed targets; the decode benchmark's smoke run."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from benchmarks import decode as bench
from runtime import attach
from runtime.fastdecode import (
    NEVER,
    SHAPES,
    Delta,
    Full,
    Lethe,
    Lychee,
    ModelShape,
    StaticCache,
    StaticDecoder,
    Weights,
    default_min_context,
)
from runtime.manifest import ModelIdentity, RoleManifest
from tests.tiny import tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, TOTAL = 90, 100


def ids_for(batch, length, seed=0):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def transformers_logits(model, ids, start):
    """Last-position logits of a dense forward over ``ids[:, :t + 1]`` for every t from ``start``."""
    with torch.no_grad():
        return [model(ids[:, : t + 1]).logits[:, -1] for t in range(start, ids.shape[1])]


def engine_logits(model, ids, start, policy, manifest, **params):
    """The rolecall engine's decode logits (dense prefill of ``ids[:, :start]``, then one token per step)."""
    out = []
    with attach(model, manifest, policy, **params), torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :start], past_key_values=cache, use_cache=True)
        for t in range(start, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return out


def static_logits(weights, policy, ids, start, **kw):
    dec = StaticDecoder(weights, policy, batch=ids.shape[0], max_len=128, **kw)
    dec.prefill(ids[:, :start])
    return [dec.step(ids[:, t]).clone() for t in range(start, ids.shape[1])]


def max_diff(got, want):
    return max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_full_step_equals_transformers(family):
    model = tiny_model(family, layers=3, heads=4, kv_heads=2, head_dim=16)
    weights = Weights.from_hf(model)
    ids = ids_for(2, 24)
    # from an empty cache, one token per step: every position goes through the decode step
    dec = StaticDecoder(weights, Full(), batch=2, max_len=32)
    got = [dec.step(ids[:, t]).clone() for t in range(ids.shape[1])]
    assert max_diff(got, transformers_logits(model, ids, 0)) < 1e-5
    assert dec.position == 24 and int(dec.cache.length) == 24
    # dense prefill, then steps; the greedy token is chosen on the device
    dec = StaticDecoder(weights, Full(), batch=2, max_len=32)
    first = dec.prefill(ids[:, :16]).clone()
    assert torch.equal(dec.tokens, first.argmax(-1))
    got = [first] + [dec.step(ids[:, t]).clone() for t in range(16, 24)]
    assert max_diff(got, transformers_logits(model, ids, 15)) < 1e-5


def test_delta_and_lychee_equal_the_engine():
    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    weights, ids = Weights.from_hf(model), ids_for(2, TOTAL)
    identity = ModelIdentity.from_config(model.config)
    roles = [0, 1, 2, 2]
    want = engine_logits(model, ids, PROMPT, "delta", RoleManifest(identity, layer_role=torch.tensor(roles, dtype=torch.int8)),
                         budget=32, page_size=16, recent_pages=1)
    got = static_logits(weights, Delta(roles, budget=32, page_size=16, recent_pages=1), ids, PROMPT, min_context=0)
    assert max_diff(got, want) < 1e-5
    assert max_diff(want, transformers_logits(model, ids, PROMPT)) > 1e-2  # the budget drops something
    # layer 1's retrieval head is the second one: its KV heads are stored in another order
    heads = torch.tensor([[1, 1], [0, 1], [0, 0], [1, 0]], dtype=torch.int8)
    want = engine_logits(model, ids, PROMPT, "lychee", RoleManifest(identity, head_role=heads), budget=32, block_size=16)
    got = static_logits(weights, Lychee(heads == 1, budget=32, block_size=16), ids, PROMPT, min_context=0)
    assert max_diff(got, want) < 1e-5
    assert max_diff(want, transformers_logits(model, ids, PROMPT)) > 1e-2


def test_sparse_policies_with_the_whole_context_equal_full():
    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    weights, ids = Weights.from_hf(model), ids_for(2, TOTAL)
    want = transformers_logits(model, ids, PROMPT)
    for policy in (Delta([0, 1, 2, 2], budget=128), Delta.standard(4, selection=(2,), budget=4096),
                   Lychee(torch.tensor([[1, 1], [0, 1], [0, 0], [1, 0]]) == 1, budget=128),
                   Lethe(budget=128)):
        assert max_diff(static_logits(weights, policy, ids, PROMPT, min_context=0), want) < 1e-5, policy.name


def test_lethe_steady_state_is_a_window_of_its_budget():
    """Each slot a new token takes held the oldest token: the layer reads the last ``budget`` tokens."""
    model = tiny_model("qwen2", layers=2, heads=4, kv_heads=2, head_dim=16)
    window = AutoModelForCausalLM.from_config(tiny_config("qwen2", layers=2, heads=4, kv_heads=2, head_dim=16,
                                                          use_sliding_window=True, sliding_window=24,
                                                          max_window_layers=0), dtype=torch.float32).eval()
    window.load_state_dict(model.state_dict())
    ids = ids_for(2, 60)
    got = static_logits(Weights.from_hf(model), Lethe(budget=24), ids, 10)
    assert max_diff(got, transformers_logits(window, ids, 10)) < 1e-5
    assert max_diff(got, transformers_logits(model, ids, 10)) > 1e-2


def test_short_contexts_fall_back_to_full():
    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    weights, ids = Weights.from_hf(model), ids_for(2, TOTAL)
    delta = Delta([0, 1, 2, 2], budget=32, recent_pages=1)
    full = static_logits(weights, Full(), ids, PROMPT)
    sparse = static_logits(weights, delta, ids, PROMPT, min_context=0)
    dec = StaticDecoder(weights, delta, batch=2, max_len=128, min_context=PROMPT + 4)
    dec.prefill(ids[:, :PROMPT])
    mixed, fell_back = [], []
    for t in range(PROMPT, TOTAL):
        fell_back.append(dec.uses_full())
        mixed.append(dec.step(ids[:, t]).clone())
    assert fell_back == [True] * 4 + [False] * (TOTAL - PROMPT - 4)
    assert max_diff(mixed[:4], full[:4]) < 1e-6 and max_diff(sparse[:4], full[:4]) > 1e-2
    assert min(float((a - b).abs().max()) for a, b in zip(mixed[4:], full[4:])) > 1e-3  # sparse from there on
    assert not StaticDecoder(weights, Lethe(budget=8), min_context=100).uses_full()  # nothing to fall back from


def test_default_min_context_follows_the_measured_crossovers():
    """The fallback threshold depends on the batch (and policy): the H200 crossovers at a 2K budget."""
    assert [default_min_context("delta", b) for b in (1, 4, 8, 64)] == [32768, 32768, 8192, 8192]
    assert [default_min_context("lychee", b) for b in (1, 7, 8, 64)] == [NEVER, NEVER, 32768, 32768]
    assert NEVER > 131072
    assert [default_min_context("lethe", b) for b in (1, 8)] == [16384, 4096]
    assert default_min_context(Full(), 1) == 0 and default_min_context(Delta([0, 1, 2]), 8) == 8192
    with pytest.raises(ValueError, match="no measured threshold"):
        default_min_context("quest", 1)
    weights = Weights.random(ModelShape(3, 32, 4, 2, 8, 64, 50), dtype=torch.float32)
    delta, lychee = Delta([0, 1, 2]), Lychee(torch.ones(3, 2, dtype=torch.bool))
    assert StaticDecoder(weights, delta, batch=1).min_context == 32768
    assert StaticDecoder(weights, delta, batch=8).min_context == 8192
    assert StaticDecoder(weights, lychee, batch=1).uses_full()  # never faster than full at batch 1
    assert StaticDecoder(weights, lychee, batch=8).min_context == 32768
    assert StaticDecoder(weights, delta, batch=1, min_context=100).min_context == 100  # an explicit one wins
    assert StaticDecoder(weights, Lethe(budget=8), batch=1).min_context == 0  # nothing to fall back from
    assert StaticDecoder(weights, Full(), batch=8).min_context == 0


def test_lychee_with_reordered_heads_reads_a_random_cache_as_full():
    """A Lychee decoder stores a layer's retrieval heads first (here layer 1's second head): a random cache
    holds the same model state as a full decoder's with the same seed, for the reference kernels and for the
    Triton ones (the GPU path, through the interpreter: one dense launch over a head prefix, one sparse)."""
    shape = ModelShape(layers=4, hidden=64, heads=8, kv_heads=2, head_dim=16, intermediate=128, vocab=100)
    weights = Weights.random(shape, dtype=torch.float32, std=0.05)
    heads = torch.tensor([[1, 1], [0, 1], [0, 0], [1, 0]]) == 1
    kernels = ["naive"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])

    def run(policy, kernels):
        dec = StaticDecoder(weights, policy, batch=2, max_len=80, min_context=0, kernels=kernels)
        dec.cache.fill_random(seed=1)
        dec.set_length(60)
        return [dec.step(torch.full((2,), 7 * i)).clone() for i in range(3)]

    want = run(Full(), "naive")
    for k in kernels:  # a budget covering the context: lychee equals full
        assert max_diff(run(Lychee(heads, budget=128, block_size=16), k), want) < 1e-4, k
    lychee = Lychee(heads, budget=128)
    assert torch.equal(StaticDecoder(weights, lychee, max_len=80).cache.head_order[1], torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="another order"):  # a cache in the model's order would be misread
        StaticDecoder(weights, lychee, max_len=80, cache=StaticCache(shape, 1, [80] * 4, "cpu", torch.float32))
    shared = StaticCache(shape, 1, [80] * 4, "cpu", torch.float32, head_order=lychee.orders())
    StaticDecoder(weights, lychee, max_len=80, cache=shared)
    with pytest.raises(ValueError, match="another order"):
        StaticDecoder(weights, Full(), max_len=80, cache=shared)


def test_policies_check_their_roles():
    with pytest.raises(ValueError, match="before any Δ-layer"):
        Delta([0, 2, 1, 2])
    weights = Weights.random(ModelShape(2, 32, 4, 2, 8, 64, 50), dtype=torch.float32)
    with pytest.raises(ValueError, match="layer roles"):
        StaticDecoder(weights, Delta([0, 1, 2]))
    with pytest.raises(ValueError, match="do not fit"):
        StaticDecoder(weights, Lychee(torch.ones(3, 2, dtype=torch.bool)))
    spread = Lychee.spread(28, 4, 32)
    assert int(spread.retrieval.sum()) == 32 and bool(spread.retrieval[0].all())
    assert all(torch.equal(o, torch.arange(4)) for o in spread.orders())  # retrieval heads come first already


def test_byte_bounds_of_the_speed_targets():
    """The byte-bound speed-up limits quoted for the targets (ANCHORS.md) follow from the shapes."""
    s7, s15 = SHAPES["7b"], SHAPES["1.5b"]
    assert abs(s7.weight_bytes(8) / 1e9 - 14.1) < 0.1  # the embedding table is not read, only 8 rows of it

    def limit(shape, policy, batch, context):
        full = shape.weight_bytes(batch) + shape.kv_bytes(batch, context)
        return full / (shape.weight_bytes(batch) + shape.kv_bytes(batch, policy.tokens_read(shape, context)))

    delta = Delta.standard(28, budget=2048)
    assert 2.8 < limit(s7, delta, 8, 131072) < 3.0
    assert 2.3 < limit(s7, Lychee.spread(28, 4, 32, budget=2048), 8, 131072) < 2.5
    assert 1.35 < limit(s7, delta, 1, 131072) < 1.45
    assert 2.3 < limit(s15, Delta.standard(28, budget=1024), 64, 9216) < 2.7
    assert StaticCache.bytes_needed(s7, 8, [131072] * 28) == 28 * 2 * 8 * 4 * 131072 * 128 * 2


def test_triton_calls_in_the_interpreter():
    """The Triton kernels as the decoder calls them (head-prefix views, int8 masks, int32 block ids)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    weights, ids = Weights.from_hf(model), ids_for(2, 42)
    heads = torch.tensor([[1, 1], [0, 1], [0, 0], [1, 0]]) == 1
    for policy in (Delta([0, 1, 2, 2], budget=16, recent_pages=1), Lychee(heads, budget=16, block_size=16)):
        want = static_logits(weights, policy, ids, 40, min_context=0, kernels="naive")
        got = static_logits(weights, policy, ids, 40, min_context=0, kernels="triton")
        assert max_diff(got, want) < 1e-4, policy.name


def test_benchmark_smoke_run(tmp_path):
    out = tmp_path / "decode.json"
    assert bench.main(["--smoke", "--contexts", "64", "--batches", "2", "--delta-samples", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {r["policy"] for r in rows} == {"full", "delta", "lychee", "lethe"}
    for r in rows:
        assert r["tpot_ms"] > 0 and r["tokens_per_s"] > 0 and r["byte_limit_fraction"] > 0
        assert r["speedup_limit"] >= 1.0
    assert report["delta_setting"]["speedup"] > 0 and len(report["crossovers"]) == 3
    assert bench.gpu_slug("NVIDIA H200") == "h200" and bench.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"


# -- on a GPU ------------------------------------------------------------------------------------------------------
GPU_SHAPE = ModelShape(layers=4, hidden=512, heads=8, kv_heads=2, head_dim=128, intermediate=1024, vocab=1000)
GPU_POLICIES = {
    "full": lambda: Full(),
    "delta": lambda: Delta([0, 1, 2, 2], budget=256),
    "lychee": lambda: Lychee(torch.tensor([[1, 1], [0, 1], [0, 0], [1, 0]]) == 1, budget=256),
    "lethe": lambda: Lethe(budget=512),
}


def gpu_decoders(policy, kernels="auto", min_context=0, batch=3, max_len=3000, start=2500):
    """Two decoders with the same weights and equal copies of one random cache."""
    weights = Weights.random(GPU_SHAPE, "cuda", torch.bfloat16, std=0.05)
    decs = []
    for _ in range(2):
        dec = StaticDecoder(weights, policy, batch, max_len, min_context=min_context, kernels=kernels)
        dec.cache.fill_random(seed=1)
        dec.set_length(start)
        decs.append(dec)
    return decs


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_POLICIES))
def test_graph_replay_equals_eager_step_on_gpu(name):
    eager, graphed = gpu_decoders(GPU_POLICIES[name]())
    graphed.capture()
    tokens = torch.randint(0, GPU_SHAPE.vocab, (6, 3), device="cuda")
    for t in tokens:
        want = eager.step(t).clone()
        got = graphed.step(t).clone()
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert int(graphed.cache.length) == int(eager.cache.length) == 2506
    torch.testing.assert_close(graphed.cache.k[3], eager.cache.k[3])
    # greedy decoding on the device: the replayed graph feeds itself the argmax of its logits
    for _ in range(3):
        token = graphed.tokens.clone()
        assert torch.equal(token, graphed.logits.argmax(-1))
        got = graphed.step().clone()
        torch.testing.assert_close(got, eager.step(token).clone(), atol=1e-2, rtol=1e-2)
    assert int(graphed.cache.length) == 2509


@pytest.mark.gpu
def test_fallback_graphs_on_gpu():
    """Below min_context the full graph runs, above it the policy's; both over the same buffers."""
    eager, graphed = gpu_decoders(GPU_POLICIES["delta"](), min_context=2503)
    graphed.capture()
    assert set(graphed.graphs) == {"policy", "full"}
    full, _ = gpu_decoders(Full())
    for i in range(6):
        t = torch.full((3,), i, device="cuda")
        want, got, dense = eager.step(t).clone(), graphed.step(t).clone(), full.step(t).clone()
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        if i < 3:
            torch.testing.assert_close(got, dense, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["delta", "lychee"])
def test_triton_decoder_matches_the_references_on_gpu(name):
    """With a budget covering the context a sparse policy equals full; Triton against the PyTorch references."""
    policy = Delta([0, 1, 2, 2], budget=4096) if name == "delta" else Lychee(
        torch.tensor([[1, 1], [0, 1], [0, 0], [1, 0]]) == 1, budget=4096)
    fast, _ = gpu_decoders(policy, kernels="triton")
    ref, _ = gpu_decoders(Full(), kernels="naive")
    fast.capture()
    for i in range(4):
        t = torch.full((3,), 7 * i, device="cuda")
        got, want = fast.step(t).float(), ref.step(t).float()
        assert float((got - want).abs().max()) <= 3e-2 * float(want.abs().max())


@pytest.mark.gpu
def test_benchmark_runs_on_gpu(tmp_path):
    out = tmp_path / "decode.json"
    assert bench.main(["--models", "1.5b", "--contexts", "8192", "--batches", "1", "--steps", "3", "--warmup", "1",
                       "--no-delta-setting", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["policy"] for r in rows} == {"full", "delta", "lychee", "lethe"}
    assert all(0 < r["byte_limit_fraction"] < 1.2 for r in rows)
