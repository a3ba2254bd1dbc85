"""The engine's decode step: held against itself (graph replay, Triton vs references, shared caches), the
byte bounds of the speed targets, the crossover data, the decode benchmark; and real models on a GPU."""

import json
import os

import pytest
import torch

from benchmarks import decode as bench
from rolecall.eval.decoding import traced_generate
from rolecall.runtime.engine import (
    NEVER,
    SHAPES,
    ModelShape,
    StaticCache,
    StaticDecoder,
    Weights,
    default_min_context,
)
from rolecall.runtime.engine.generate import Decoders, generate
from tests.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def policy(name, shape, budget=2048, heads=32):
    return bench.make_policy(name, shape, budget, heads)


def max_diff(got, want):
    return max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))


def test_byte_bounds_of_the_speed_targets():
    """The byte-bound speed-up limits quoted for the targets (ANCHORS.md) follow from the shapes."""
    s7, s15 = SHAPES["7b"], SHAPES["1.5b"]
    assert abs(s7.weight_bytes(8) / 1e9 - 14.1) < 0.1  # the embedding table is not read, only 8 rows of it

    def limit(shape, p, batch, context):
        full = shape.weight_bytes(batch) + shape.kv_bytes(batch, context)
        return full / (shape.weight_bytes(batch) + shape.kv_bytes(batch, p.static_step(shape).reads(shape, context)))

    assert 2.8 < limit(s7, policy("delta", s7), 8, 131072) < 3.0
    assert 2.3 < limit(s7, policy("lychee", s7), 8, 131072) < 2.5
    assert 1.35 < limit(s7, policy("delta", s7), 1, 131072) < 1.45
    assert 2.3 < limit(s15, policy("delta", s15, budget=1024), 64, 9216) < 2.7
    assert StaticCache.bytes_needed(s7, 8, 131072) == 28 * 2 * 8 * 4 * 131072 * 128 * 2
    refine = policy("delta-refine", s7).static_step(s7)  # the benchmark's two-stage case: same reads as delta
    assert refine.refine == 4 and refine.reads(s7, 131072) == policy("delta", s7).static_step(s7).reads(s7, 131072)


@pytest.mark.parametrize("window", [1, 3, 8, 64])
@pytest.mark.parametrize("chunks", [(4, 2), (4, 1, 7, 2)])
def test_a_sliding_layers_ring_holds_each_rows_last_window(window, chunks):
    """A hybrid model's sliding layer holds ``n + 1`` slots, ``n = min(window, slots)``, whatever the request's
    length (a cache shorter than the window: its slots, never wrapped): written in chunks of any size (the
    prefill's, padding included) and then one token a step at each row's own slot, the ring gives back every
    row's tokens of the last ``window`` slots, and the step's span covers exactly the row's last
    ``min(p + 1, window)`` tokens; padding never lands in a readable slot. A window on every layer keeps every
    slot."""
    import dataclasses

    from rolecall.runtime.engine.cache import ring_slots, ring_span

    shape = dataclasses.replace(SHAPES["1.5b"], layers=3, kv_heads=2, head_dim=4, windows=(window, None, window))
    b, slots, pads = 3, 40, torch.tensor([0, 5, 2])
    cache = StaticCache(shape, b, slots, "cpu", torch.float32)
    held = min(window, slots)
    assert cache.rings == {0: held, 2: held} and [t.shape[2] for t in cache.k] == [held + 1, slots, held + 1]
    assert cache.nbytes == StaticCache.bytes_needed(shape, b, slots, element=4) == \
        2 * 4 * b * 2 * 4 * (slots + 2 * (held + 1))  # K and V, float32, 2 KV heads of 4
    cache.pads.copy_(pads)
    truth = torch.randn(b, 2, slots, 4)  # every slot's key, padding included
    truth_v = truth + 100
    filled = 0
    for n in chunks:  # the prefill in chunks
        cache.write_ring(0, filled, truth[:, :, filled:filled + n], truth_v[:, :, filled:filled + n])
        filled += n
    last = torch.tensor(held - 1)
    for t in range(filled, slots):
        if t > filled:  # decode steps: each row its own slot, from its position
            positions = t - pads
            at = ring_slots(positions, held)
            rows = torch.arange(b)
            cache.k[0][rows, :, at], cache.v[0][rows, :, at] = truth[:, :, t], truth_v[:, :, t]
            span = ring_span(positions, held, last)
            for r in range(b):  # the readable slots hold exactly the row's last min(p + 1, window) tokens
                want = {float(truth[r, 0, j, 0]) for j in range(max(int(pads[r]), t - window + 1), t + 1)}
                got = {float(cache.k[0][r, 0, j, 0]) for j in range(int(span.first[r]), held)}
                assert got == want, (window, t, r)
        else:  # one more token written as the prefill writes it
            cache.write_ring(0, t, truth[:, :, t:t + 1], truth_v[:, :, t:t + 1])
        lo = max(0, t - window + 1)
        k, v = cache.read_ring(0, lo, t + 1)
        real = torch.arange(lo, t + 1)[None, :] >= pads[:, None]  # [B, n]: not padding
        assert torch.equal(k[real[:, None, :, None].expand_as(k)], truth[:, :, lo:t + 1][real[:, None, :, None].expand_as(k)])
        assert torch.equal(v[real[:, None, :, None].expand_as(v)], truth_v[:, :, lo:t + 1][real[:, None, :, None].expand_as(v)])
    mistral = StaticCache(dataclasses.replace(shape, windows=(window,) * 3), b, slots, "cpu", torch.float32)
    assert mistral.rings == {} and all(t.shape[2] == slots for t in mistral.k)


def test_default_min_context_follows_the_measured_crossovers():
    assert [default_min_context("delta", b) for b in (1, 4, 8, 15, 16, 64)] == [32768, 32768, 8192, 8192, 4096, 4096]
    assert [default_min_context("lychee", b) for b in (1, 7, 8, 16, 63, 64)] == [65536, 65536, 32768, 8192, 8192, 4096]
    assert [default_min_context("quest", b) for b in (1, 8, 16, 64, 256)] == [NEVER, 32768, 8192, 4096, 4096]
    assert [default_min_context("vattention", b) for b in (1, 8)] == [NEVER, 131072]
    assert default_min_context("lethe", 64) == 0  # no entry: lethe runs its own step from the first token
    assert default_min_context("full", 1) == 0 and NEVER > 131072
    # a 1K budget crosses over earlier from 16 rows; below 16, and for larger budgets, the 2K rows hold
    assert [default_min_context("delta", b, 1024) for b in (8, 16, 63, 64)] == [8192, 2048, 2048, 1536]
    assert [default_min_context("delta", 64, t) for t in (512, 1024, 1025, 2048, 4096)] == [1536, 1536, 4096, 4096, 4096]
    from rolecall.runtime.policies import get_policy
    assert default_min_context(get_policy("delta"), 64) == 1536  # the paper's default K = 64 pages of 16
    assert default_min_context(get_policy("delta", budget=2048), 64) == 4096
    assert default_min_context(get_policy("lychee", budget=1024), 64) == 4096  # measured at 2K only
    shape = ModelShape(3, 32, 4, 2, 8, 64, 50)
    weights = Weights.random(shape, dtype=torch.float32, positions=256)
    assert StaticDecoder(weights, policy("delta", shape), batch=1, max_len=64).min_context == 32768
    assert StaticDecoder(weights, policy("delta", shape), batch=8, max_len=64).min_context == 8192
    assert StaticDecoder(weights, policy("lychee", shape, heads=2), batch=1, max_len=64).uses_full()
    assert StaticDecoder(weights, policy("delta", shape), max_len=64, min_context=10).min_context == 10
    assert StaticDecoder(weights, None, batch=8, max_len=64).min_context == 0


def test_lychee_with_reordered_heads_reads_a_random_cache_as_full():
    """A lychee decoder stores a layer's retrieval heads first: a random cache holds the same model state as a
    full decoder's with the same seed, for the reference kernels and (through the interpreter) the Triton ones."""
    from rolecall.core.manifest import ModelIdentity, RoleManifest
    from rolecall.runtime.policies import get_policy

    shape = ModelShape(layers=4, hidden=64, heads=8, kv_heads=2, head_dim=16, intermediate=128, vocab=100)
    weights = Weights.random(shape, dtype=torch.float32, std=0.05, positions=256)
    heads = torch.tensor([[1, 1], [0, 1], [0, 0], [1, 0]], dtype=torch.int8)
    kernels = ["naive"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])

    def lychee(budget):
        p = get_policy("lychee", budget=budget, block_size=16)
        p.bind(RoleManifest(ModelIdentity(4, 8, 2, 16), head_role=heads), bench._config(shape))
        return p

    def run(p, kernels):
        dec = StaticDecoder(weights, p, batch=2, max_len=80, min_context=0, kernels=kernels)
        dec.cache.fill_random(seed=1)
        dec.set_length(60)
        return [dec.step(torch.full((2,), 7 * i)).clone() for i in range(3)]

    want = run(None, "naive")
    for k in kernels:  # a budget covering the context: lychee equals full
        assert max_diff(run(lychee(128), k), want) < 1e-4, k
    small = run(lychee(16), "naive")
    assert max_diff(small, want) > 1e-3  # and a small one does not
    for k in kernels[1:]:  # the Triton kernels choose as the references do (two of four blocks: sets that differ)
        assert max_diff(run(lychee(32), k), run(lychee(32), "naive")) < 1e-4, k
    # layer 0's head 1 and layer 3's head 0 retrieve, and nothing reads their choice
    step = lychee(128).static_step(shape)
    assert step.n_choosing == [1, 1, 0, 0] and step.n_retrieval == [2, 1, 0, 1]
    order = lychee(128).static_step(shape).head_order
    assert torch.equal(StaticDecoder(weights, lychee(128), max_len=80).cache.head_order[1], torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="another order"):  # a cache in the model's order would be misread
        StaticDecoder(weights, lychee(128), max_len=80, cache=StaticCache(shape, 1, 80, "cpu", torch.float32))
    shared = StaticCache(shape, 1, 80, "cpu", torch.float32, head_order=order)
    StaticDecoder(weights, lychee(128), max_len=80, cache=shared)
    with pytest.raises(ValueError, match="another order"):
        StaticDecoder(weights, None, max_len=80, cache=shared)


def test_triton_calls_in_the_interpreter():
    """The Triton kernels as the decoder calls them (head-prefix views, int8 masks, int32 block ids, windows)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.core.manifest import ModelIdentity, RoleManifest
    from rolecall.runtime.policies import get_policy

    for family, layers in (("qwen2", 4), ("gemma3", 6)):
        model = tiny_model(family, layers=layers, heads=4, kv_heads=2, head_dim=16)
        weights = Weights.from_model(model, positions=128)
        identity = ModelIdentity.from_config(model.config)
        roles = [0, 1, 2, 2] if layers == 4 else [0, 0, 1, 0, 0, 2]
        delta = get_policy("delta", budget=16, recent_pages=1)
        delta.bind(RoleManifest(identity, layer_role=torch.tensor(roles, dtype=torch.int8)), model.config)
        per_head = get_policy("delta", budget=16, recent_pages=1, per_head=True)
        per_head.bind(RoleManifest(identity, layer_role=torch.tensor(roles, dtype=torch.int8)), model.config)
        refine = get_policy("delta", budget=16, recent_pages=1, refine=2)
        refine.bind(RoleManifest(identity, layer_role=torch.tensor(roles, dtype=torch.int8)), model.config)
        heads = torch.tensor([[1, 1], [0, 1], [0, 0], [1, 0], [0, 1], [0, 0]][:layers], dtype=torch.int8)
        lychee = get_policy("lychee", budget=16, block_size=16)
        lychee.bind(RoleManifest(identity, head_role=heads), model.config)
        # batch 8: a mixed retrieval/sparse layer takes two launches there, one below (rolecall.runtime.engine.decoder)
        for batch in (2, 8):
            ids = torch.randint(0, 256, (batch, 42), generator=torch.Generator().manual_seed(0))
            pads = [0, 5] + [3] * (batch - 2)
            quest = get_policy("quest", budget=16, page_size=16, dense_layers=1)
            vatt = get_policy("vattention", epsilon=0.3, delta=0.3, sinks=2, window=4, heavy=4, pilot=4, max_sample=8)
            combined = get_policy("vattention", epsilon=0.3, delta=0.3, sinks=2, window=4, heavy=4, pilot=4,
                                  max_sample=8)
            combined.bind(RoleManifest(identity, layer_role=torch.tensor(roles, dtype=torch.int8)), model.config)
            lethe = get_policy("lethe", budget=24, sinks=2, recent_ratio=0.2, segments=3)
            lethe.bind(None, model.config)
            for p in (delta, per_head, refine, lychee, quest, vatt, combined, lethe):
                check_kernels(weights, p, ids, pads, family)


def test_refine_past_one_program_takes_the_reference_in_the_interpreter(monkeypatch):
    """More candidates per head than one Triton program holds: the refining step takes the reference choice
    (as the top-k does over long rows) instead of failing mid-step, and still equals the naive decoder."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.core.manifest import ModelIdentity, RoleManifest
    from rolecall.runtime.kernels.page_bounds import triton as pb_triton
    from rolecall.runtime.kernels.topk_select import triton as topk_triton
    from rolecall.runtime.policies import get_policy

    monkeypatch.setattr(topk_triton, "MAX_N", 2)  # fewer than the 3 candidates below (3 pages of 16 at 42 tokens)
    monkeypatch.setattr(pb_triton, "MAX_N", 2)
    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    weights = Weights.from_model(model, positions=128)
    refine = get_policy("delta", budget=16, recent_pages=1, refine=4)
    refine.bind(RoleManifest(ModelIdentity.from_config(model.config),
                             layer_role=torch.tensor([0, 1, 2, 2], dtype=torch.int8)), model.config)
    ids = torch.randint(0, 256, (2, 42), generator=torch.Generator().manual_seed(0))
    check_kernels(weights, refine, ids, [0, 5], "qwen2")


def check_kernels(weights, p, ids, pads, family):
    out = {}
    for kernels in ("naive", "triton"):
        dec = StaticDecoder(weights, p, batch=ids.shape[0], max_len=48, min_context=0, kernels=kernels)
        dec.prefill(ids[:, :40], pads=pads)
        out[kernels] = [dec.step(ids[:, t]).clone() for t in range(40, 42)]
    assert max_diff(out["triton"], out["naive"]) < 1e-4, (family, p.name, ids.shape[0])


def test_benchmark_smoke_run(tmp_path):
    out = tmp_path / "decode.json"
    assert bench.main(["--smoke", "--contexts", "64", "--batches", "2", "--delta-samples", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {r["policy"] for r in rows} == {"full", "delta", "lychee"}
    for r in rows:
        assert r["tpot_ms"] > 0 and r["tokens_per_s"] > 0 and r["byte_limit_fraction"] > 0
        assert r["speedup_limit"] >= 1.0
    assert report["delta_setting"]["speedup"] > 0 and len(report["crossovers"]) == 2
    assert report["dependent_launch"] is False  # recorded with the figures; the CPU has none
    assert bench.gpu_slug("NVIDIA H200") == "h200" and bench.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"


def test_benchmark_refuses_an_unknown_policy_before_timing(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke", "--policies", "full,bogus"])
    assert "--policies: unknown bogus; known: full, delta" in capsys.readouterr().err


# -- on a GPU ------------------------------------------------------------------------------------------------------
GPU_SHAPE = ModelShape(layers=4, hidden=512, heads=8, kv_heads=2, head_dim=128, intermediate=1024, vocab=1000)


def gpu_decoders(name, kernels="auto", min_context=0, batch=3, max_len=3000, start=2500, budget=256):
    """Two decoders with the same weights and equal copies of one random cache."""
    weights = Weights.random(GPU_SHAPE, "cuda", torch.bfloat16, std=0.05, positions=4096)
    decs = []
    for _ in range(2):
        dec = StaticDecoder(weights, policy(name, GPU_SHAPE, budget, 5), batch, max_len, min_context=min_context,
                            kernels=kernels)
        dec.cache.fill_random(seed=1)
        dec.set_length(start)
        decs.append(dec)
    return decs


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["full", "delta", "delta-refine", "lychee", "quest", "vattention", "lethe"])
def test_graph_replay_equals_eager_step_on_gpu(name):
    eager, graphed = gpu_decoders(name)
    graphed.capture()
    tokens = torch.randint(0, GPU_SHAPE.vocab, (6, 3), device="cuda")
    for t in tokens:
        torch.testing.assert_close(graphed.step(t).clone(), eager.step(t).clone(), atol=1e-2, rtol=1e-2)
    assert int(graphed.cache.length) == int(eager.cache.length) == 2506
    torch.testing.assert_close(graphed.cache.k[3], eager.cache.k[3])
    for _ in range(3):  # greedy decoding on the device: the replayed graph feeds itself its argmax
        token = graphed.tokens.clone()
        assert torch.equal(token, graphed.logits.argmax(-1))
        torch.testing.assert_close(graphed.step().clone(), eager.step(token).clone(), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_projection_kernels_launch_in_the_captured_step_not_in_eager_passes_on_gpu(monkeypatch):
    """The eager prefill of a short prompt and an uncaptured step project on cuBLAS (a Triton launch costs the host
    several times more there); the capture of the step, and its warm-up, launch the projections' kernels, and the
    replayed step stays within bf16 rounding of the eager one."""
    from rolecall.runtime.kernels.skinny_linear import triton as sl_tri

    launched = []
    kernels = {name: getattr(sl_tri, name) for name in ("_skinny_linear", "_split_linear")}

    class Spy:  # records each launch of the wrapped kernel, then launches it
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launched.append(grid)
            return self.kernel[grid]

    for name, kernel in kernels.items():
        monkeypatch.setattr(sl_tri, name, Spy(kernel))
    shape = ModelShape(layers=2, hidden=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=1000)
    weights = Weights.random(shape, "cuda", torch.bfloat16, std=0.05, positions=256)
    ids = torch.randint(0, shape.vocab, (1, 40), device="cuda")
    graphed, eager = (StaticDecoder(weights, None, 1, 64, compile=False) for _ in range(2))
    for dec in (graphed, eager):
        dec.prefill(ids)
        dec.step(torch.tensor([5], device="cuda"))
    assert launched == []
    graphed.capture()
    assert launched and graphed.graphs
    for i in range(3):  # Triton's projections against cuBLAS's: bf16 rounding apart
        t = torch.tensor([7 * i], device="cuda")
        got, want = graphed.step(t).float(), eager.step(t).float()
        assert float((got - want).abs().max()) <= 3e-2 * float(want.abs().max()), i


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["full", "lethe"])
def test_capture_time_is_counted_where_the_capture_runs_on_gpu(name):
    """A capture that waits for the policy to settle (lethe's first step) still counts as capture time."""
    dec, _ = gpu_decoders(name)
    dec.capture()
    waited = not dec.graphs  # lethe: deferred until its first step has settled the buffers
    assert waited == (name == "lethe") and (dec.capture_s > 0) != waited
    for i in range(3):
        dec.step(torch.full((3,), i, device="cuda"))
    assert dec.graphs and dec.capture_s > 0


@pytest.mark.gpu
def test_fallback_graphs_on_gpu():
    """Below min_context the full graph runs, above it the policy's; both over the same buffers."""
    eager, graphed = gpu_decoders("delta", min_context=2503)
    graphed.capture()
    assert set(graphed.graphs) == {("policy", None), ("full", None)}  # (kind of step, sampler mode; None: no sampler)
    full, _ = gpu_decoders("full")
    for i in range(6):
        t = torch.full((3,), i, device="cuda")
        want, got, dense = eager.step(t).clone(), graphed.step(t).clone(), full.step(t).clone()
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        if i < 3:
            torch.testing.assert_close(got, dense, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["full", "delta", "delta-refine", "lychee", "quest", "vattention"])
def test_a_kept_decoder_replays_its_graphs_for_the_next_requests_on_gpu(name):
    """Requests on the decoder ``Decoders`` keeps give what a new decoder of the same size gives, token for
    token; a request below ``min_context`` adds the full step's graph once (the first ran above it), and the
    third captures nothing."""
    weights = Weights.random(GPU_SHAPE, "cuda", torch.bfloat16, std=0.05, positions=4096)
    pol = policy(name, GPU_SHAPE, 256, 5)
    kept, g = Decoders(), torch.Generator().manual_seed(0)
    captured, held = [], []
    # prompts past the prefill graphs' widths (1,024), so that they are not padded: 1,524 slots → 1,536, then
    # 1,444 and 1,244 fit; the second and third start below min_context
    for lengths in ((1500, 1450), (1400, 1420), (1200, 1220)):
        rows = [torch.randint(0, GPU_SHAPE.vocab, (n,), generator=g).tolist() for n in lengths]
        common = dict(max_new_tokens=24, min_context=1440)
        got = generate(weights, pol, rows, decoders=kept, **common)
        want = generate(weights, pol, rows, decoders=Decoders(), **common)
        assert got.tokens == want.tokens and got.info["graphs"] and got.info["cache_slots"] == 1536
        captured.append(got.info["capture_s"])
        held.append(kept.kept)
    assert held[0] is held[1] is held[2]
    sparse = name != "full"
    assert captured[0] > 0 and (captured[1] > 0) == sparse and captured[2] == 0
    assert {kind for kind, _ in held[0].graphs} == ({"policy", "full"} if sparse else {"policy"})


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["full", "delta", "lychee"])
def test_a_kept_decoder_replays_its_prefill_graph_for_short_prompts_on_gpu(name):
    """Short prompts are left-padded to a graph width; a decoder prefills a width eagerly the first time and from a
    CUDA graph from the second (the same logits and cache bit for bit, for other prompts of that width too), and
    requests on a kept decoder give a new decoder's tokens."""
    from rolecall.runtime.engine import pad_left
    from rolecall.runtime.engine.prefill import graph_width

    weights = Weights.random(GPU_SHAPE, "cuda", torch.bfloat16, std=0.05, positions=4096)
    pol = policy(name, GPU_SHAPE, 256, 5)
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randint(0, GPU_SHAPE.vocab, (n,), generator=g).tolist() for n in lengths]
               for lengths in ((40, 33), (45, 41), (35, 48))]
    assert {graph_width(max(map(len, rows)), 2) for rows in batches} == {48}

    def prefilled(dec, rows):
        ids, pads = pad_left(rows, 0, "cuda", 48)
        logits = dec.prefill(ids, pads, graph=True).clone()
        return logits, [t[:, :, :48].clone() for t in dec.cache.k + dec.cache.v]

    dec = StaticDecoder(weights, pol, 2, 256, min_context=0)
    eager = [prefilled(StaticDecoder(weights, pol, 2, 256, min_context=0), rows) for rows in batches]
    for k, rows in enumerate(batches + batches[:1]):
        dec.reset()
        logits, cache = prefilled(dec, rows)
        want_logits, want_cache = eager[k % len(batches)]
        assert torch.equal(logits, want_logits) and all(torch.equal(a, b) for a, b in zip(cache, want_cache))
        assert set(dec.prefill_graphs.graphs) == (set() if k == 0 else {48})

    kept = Decoders()
    for k, rows in enumerate(batches):
        got = traced_generate(weights, pol, rows, decoders=kept, max_new_tokens=16, keep_prefill=True)
        want = generate(weights, pol, rows, decoders=Decoders(), max_new_tokens=16)  # a new decoder: eager prefill
        assert got.tokens == want.tokens and got.info["cache_slots"] == 256  # 48 + 16 slots → the smallest cache
        assert set(kept.kept.prefill_graphs.graphs) == (set() if k == 0 else {48})
    # a kept prefill (padded to its width) serves another policy's request on the same prompts
    again = traced_generate(weights, policy("full", GPU_SHAPE), batches[-1], max_new_tokens=16,
                            prefilled=got.prefilled)
    fresh = generate(weights, policy("full", GPU_SHAPE), batches[-1], max_new_tokens=16)
    assert got.prefilled.ids.shape[1] == 48 and again.tokens == fresh.tokens


HYBRID_SHAPE = ModelShape(layers=4, hidden=512, heads=8, kv_heads=2, head_dim=128, intermediate=1024, vocab=1000,
                          windows=(32, None, 24, None))  # Gemma 3's layout: sliding layers held as rings


@pytest.mark.gpu
@pytest.mark.parametrize("short", [False, True])
def test_a_hybrid_models_rings_on_gpu(short):
    """A hybrid model's sliding layers held as rings, on the GPU: after a ragged prefill longer than the windows
    (or a short batch's, from its CUDA graph the second time: ring reads and writes captured, logits and cache
    bit for bit as the eager pass), the Triton step replayed from a graph, each row writing its own ring slot,
    follows the reference kernels' eager step past several wraps of the rings."""
    from rolecall.runtime.engine import pad_left

    weights = Weights.random(HYBRID_SHAPE, "cuda", torch.bfloat16, std=0.05, positions=4096)
    g = torch.Generator().manual_seed(2)
    lengths = ((40, 33, 47), (45, 41, 35)) if short else ((300, 257, 290),)
    batches = [[torch.randint(0, HYBRID_SHAPE.vocab, (n,), generator=g).tolist() for n in row] for row in lengths]
    fast = StaticDecoder(weights, None, 3, 512, kernels="triton", min_context=0)
    ref = StaticDecoder(weights, None, 3, 512, kernels="naive", min_context=0, compile=False)
    assert sorted(fast.cache.rings) == [0, 2] and [t.shape[2] for t in fast.cache.k] == [33, 512, 25, 512]
    for k, rows in enumerate(batches):
        ids, pads = pad_left(rows, 0, "cuda", 48 if short else None)
        fast.reset()
        got = fast.prefill(ids, pads, graph=True).clone()
        assert set(fast.prefill_graphs.graphs) == (set() if k == 0 or not short else {48})
        eager = StaticDecoder(weights, None, 3, 512, kernels="triton", min_context=0)
        assert torch.equal(got, eager.prefill(ids, pads))
        assert all(torch.equal(a, b) for a, b in zip(fast.cache.k + fast.cache.v, eager.cache.k + eager.cache.v))
    ref.prefill(ids, pads)
    fast.capture()
    for i in range(70):  # more than twice the longest window
        t = torch.full((3,), 7 * i % HYBRID_SHAPE.vocab, device="cuda")
        got, want = fast.step(t).float(), ref.step(t).float()
        assert float((got - want).abs().max()) <= 3e-2 * float(want.abs().max()), i
    assert fast.graphs


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["delta", "delta-refine", "lychee"])
@pytest.mark.parametrize("batch", [3, 48])  # 48 × 2 KV heads: the attention runs one program a row (choose_launch)
def test_triton_decoder_matches_the_references_on_gpu(name, batch):
    """With a budget covering the context a sparse policy equals full; Triton against the PyTorch references."""
    fast, _ = gpu_decoders(name, kernels="triton", budget=4096, batch=batch)
    ref, _ = gpu_decoders("full", kernels="naive", batch=batch)
    fast.capture()
    for i in range(4):
        t = torch.full((batch,), 7 * i, device="cuda")
        got, want = fast.step(t).float(), ref.step(t).float()
        assert float((got - want).abs().max()) <= 3e-2 * float(want.abs().max())


@pytest.mark.gpu
@pytest.mark.slow
def test_embedded_model_generates_as_transformers_on_gpu():
    """SmolLM2-135M on the engine (CUDA graphs, Triton): greedy 64 tokens equal model.generate in float32, and
    in bf16 the step logits stay within bf16 tolerance of transformers' on the same tokens."""
    from rolecall.core.models import load_model, load_tokenizer
    from rolecall.runtime import attach

    name = os.environ.get("ROLECALL_TEST_MODEL", "smollm2-135m")  # a GGUF path where the package is absent
    tok = load_tokenizer(name)
    prompts = ["The history of the printing press", "def fibonacci(n):", "Ten facts about the Moon:"]
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(name, dtype=dtype).to("cuda")
        for text in prompts:
            ids = tok(text, return_tensors="pt")["input_ids"].to("cuda")
            kw = dict(input_ids=ids, max_new_tokens=64, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
            want = model.generate(**kw)
            with attach(model, None, "full") as session:
                got = session.generate(**kw)
                assert session.last is not None and session.last.info["graphs"]
            if dtype == torch.float32:
                assert torch.equal(got.sequences, want.sequences), text
            else:  # the engine's logits on the engine's tokens, against one transformers forward over them
                with torch.no_grad():
                    ref = model(got.sequences).logits[0, ids.shape[1] - 1:-1].float()
                mine = torch.stack([lg[0] for lg in got.logits]).float()
                assert float((mine - ref).abs().max()) <= 0.05 * float(ref.abs().max()), text


@pytest.mark.gpu
def test_benchmark_runs_on_gpu(tmp_path):
    out = tmp_path / "decode.json"
    assert bench.main(["--models", "1.5b", "--contexts", "8192", "--batches", "1", "--steps", "3", "--warmup", "1",
                       "--no-delta-setting", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["policy"] for r in rows} == {"full", "delta", "lychee"}
    assert all(0 < r["byte_limit_fraction"] < 1.2 for r in rows)


def test_mixed_launch_scores_its_full_heads_as_the_dense_reference():
    """One launch where the first KV heads read everything and score blocks while the rest read their blocks:
    outputs and the full heads' block scores equal the references (odd length, GQA 3, a masked prefix)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.runtime.kernels.page_scores import naive as page_naive
    from rolecall.runtime.kernels.page_scores import triton as page_triton
    from rolecall.runtime.kernels.sparse_attention import naive as attention_naive

    g = torch.Generator().manual_seed(3)
    b, hkv, groups, t, d, bs = 2, 4, 3, 77, 16, 16
    q = torch.randn(b, hkv * groups, d, generator=g)
    k, v = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)
    mask = torch.arange(t)[None, :] >= torch.tensor([[0], [5]])  # row 1 left-padded by 5
    idx = torch.tensor([[0, 3, -1], [4, 1, 2]], dtype=torch.int32)[:, None].expand(b, hkv, 3).contiguous()
    for r in (1, 3):
        out, lse, logits = page_triton.mixed_keeping_logits(q, k, v, idx, 0.25, bs, r, key_mask=mask, chunk=32,
                                                            tile=16)
        scores = page_triton.page_scores_from_logits(logits, lse[:, :r * groups], bs, r, per_kv_head=True)
        want_full, _, want_scores = page_naive.decode_and_score(q[:, :r * groups], k[:, :r], v[:, :r], 0.25, bs,
                                                                key_mask=mask, per_kv_head=True)
        want_rest, _ = attention_naive.sparse_decode_attention(q[:, r * groups:], k[:, r:], v[:, r:], idx[:, r:],
                                                              scale=0.25, block_size=bs, key_mask=mask)
        torch.testing.assert_close(out, torch.cat([want_full, want_rest], 1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(scores, want_scores, atol=1e-5, rtol=1e-4)
        assert scores.shape == (b, r, 5)
        # only the first c full heads keep logits (those whose choice is read), the output unchanged
        for c in range(r + 1):
            out_c, lse_c, kept = page_triton.mixed_keeping_logits(q, k, v, idx, 0.25, bs, r, key_mask=mask,
                                                                  chunk=32, tile=16, keeping_heads=c)
            torch.testing.assert_close(out_c, out, atol=0, rtol=0)
            if c == 0:
                assert kept is None
            else:
                assert kept.shape == (b, c * groups, t) and torch.equal(kept, logits[:, :c * groups])
    _, _, dense = page_triton.decode_keeping_logits(q, k, v, 0.25, key_mask=mask, chunk=32, tile=16)
    _, _, two = page_triton.decode_keeping_logits(q, k, v, 0.25, key_mask=mask, chunk=32, tile=16, keeping_heads=2)
    assert two.shape == (b, 2 * groups, t) and torch.equal(two, dense[:, :2 * groups])
    with pytest.raises(ValueError, match="keeping_heads must be 0 to full_heads = 1"):
        page_triton.mixed_keeping_logits(q, k, v, idx, 0.25, bs, 1, key_mask=mask, keeping_heads=2)


def test_quest_rebuilds_its_pages_after_the_full_fallback():
    """Below min_context the full step keeps no page metadata; the first Quest step after it rebuilds every
    page, so the bounds it ranks by are those of the cache, not stale or empty."""
    from rolecall.runtime.kernels.page_bounds import page_minmax
    from rolecall.runtime.policies import get_policy

    shape = ModelShape(layers=3, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100)
    weights = Weights.random(shape, dtype=torch.float32, std=0.05, positions=128)
    quest = get_policy("quest", budget=32, page_size=16, dense_layers=1)
    dec = StaticDecoder(weights, quest, batch=2, max_len=96, min_context=60)
    dec.prefill(torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(0)), pads=[0, 3])
    while dec.position < 70:
        dec.step()
    c, static = dec.cache, dec.static
    keep = torch.arange(dec.position)[None, :] >= c.pads[:, None]
    for i in static.meta.kmin:
        lo, hi = page_minmax(c.k[i][:, :, :dec.position], keep, 16)
        n = lo.shape[2]
        assert torch.equal(static.meta.kmin[i][:, :, :n], lo) and torch.equal(static.meta.kmax[i][:, :, :n], hi), i
        assert torch.isinf(static.meta.kmin[i][:, :, n:]).all()  # pages not reached yet stay empty


def test_a_step_whose_compilation_fails_runs_eagerly_with_one_line(capsys):
    """``StaticDecoder.compiled``: when torch.compile itself fails on a call (inductor's codegen error seen on
    lethe's eviction at 16K slots), that call and every later one run the eager function, with one notice; an
    error of the function itself still reaches the caller."""
    from torch._inductor.exc import InductorError

    from rolecall.runtime.engine.compiling import FallsBackToEager as _FallsBackToEager

    calls = []

    def broken_compile(*args):
        calls.append("compiled")
        raise InductorError(TypeError("list indices must be integers"), None)

    def evict(x):
        calls.append("eager")
        if x < 0:
            raise ValueError("bad input")
        return 2 * x

    step = _FallsBackToEager(evict, broken_compile)
    assert step(3) == 6 and step(4) == 8
    assert calls == ["compiled", "eager", "eager"]  # compiled once, eager from then on
    err = capsys.readouterr().err
    assert err.count("torch.compile failed on") == 1 and "InductorError" in err and "evict" in err
    with pytest.raises(ValueError, match="bad input"):
        step(-1)
    def strict(x):
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):  # the function's own error is not a compile failure
        _FallsBackToEager(strict, strict)(-1)
    calls.clear()
    assert _FallsBackToEager(evict, broken_compile)(5) == 10  # a later decoder's step: no second compilation
    assert calls == ["eager"] and not capsys.readouterr().err
