"""Lethe: evicted slots are really freed, the result equals masking the same slots, budgets are kept."""

import pytest
import torch
from transformers import DynamicCache

from rolecall.core.manifest import ModelIdentity, RoleManifest
from rolecall.core.models import cache_keyword
from rolecall.runtime import attach
from rolecall.runtime.policies import get_policy
from rolecall.runtime.policies.lethe import LetheCache
from tests.tiny import tiny_model

GEN = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=259)


pytestmark = pytest.mark.usefixtures("one_thread")


def padded(size, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (size, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, size):
        mask[row, : 5 * row] = 0
    return ids, mask


def manifest(model, budget):
    return RoleManifest(ModelIdentity.from_config(model.config), layer_budget=torch.tensor(budget))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("params", [{"budget": 24}, {"sparse_ratio": 0.5}])
def test_freeing_equals_masking_and_respects_the_budget(family, params):
    model = tiny_model(family, layers=4, heads=4, kv_heads=2, head_dim=16)
    ids, mask = padded(3, 40)
    man = manifest(model, [1.0, 0.5, 0.25, 0.25])  # fractions of the context, as calibrate-delta writes them
    with attach(model, man, "lethe", **params) as session:
        cache = session.cache()
        assert isinstance(cache, LetheCache)
        freed = model.generate(input_ids=ids, attention_mask=mask, **{cache_keyword(model): cache}, max_new_tokens=16, **GEN)
        logical = 40 + 15  # the last generated token is never fed back
        caps = [session.policy.capacity(layer, logical) for layer in range(4)]
        slots = cache.slots()
        kept = [layer["kept_fraction"] for layer in session.summary()["layers"]]
    assert all(s <= c for s, c in zip(slots, caps)), (slots, caps)
    assert slots[0] > slots[3]  # the manifest's per-layer shares are followed
    assert kept == pytest.approx([s / logical for s in slots])
    assert cache.get_seq_length() == logical  # positions stay logical for transformers
    with attach(model, man, "lethe", **params):
        masked = model.generate(input_ids=ids, attention_mask=mask, **{cache_keyword(model): DynamicCache(config=model.config)},
                                max_new_tokens=16, **GEN)
    assert torch.equal(freed.sequences, masked.sequences)
    for a, b in zip(freed.logits, masked.logits):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))


def test_memory_is_lower_and_plateaus():
    model = tiny_model("llama", layers=4, heads=4, kv_heads=2, head_dim=16)
    ids, mask = padded(2, 64)
    with attach(model, None, "lethe", budget=32) as session:
        cache = session.cache()
        model.generate(input_ids=ids, attention_mask=mask, **{cache_keyword(model): cache}, max_new_tokens=40, **GEN)
    dense = DynamicCache(config=model.config)
    model.generate(input_ids=ids, attention_mask=mask, **{cache_keyword(model): dense}, max_new_tokens=40, **GEN)
    full_bytes = sum(layer.keys.numel() * 4 * 2 for layer in dense.layers)
    assert cache.slots() == [32] * 4 and dense.layers[0].keys.shape[-2] == 64 + 39
    assert cache.nbytes() == full_bytes * 32 // (64 + 39)


def test_eviction_keeps_sinks_and_recent_tokens():
    policy = get_policy("lethe", budget=20, sinks=3, recent_ratio=0.25, segments=2, tau=1.0)
    policy.bind(None, type("Config", (), {"num_hidden_layers": 1})())
    scores = torch.rand(2, 50)
    scores[:, 10] = 5.0  # a heavy hitter in the middle
    valid = torch.ones(2, 50, dtype=torch.bool)
    valid[1, :4] = False  # padding: sinks are the first valid tokens
    kept = policy._keep(scores, valid, 20)
    assert kept.shape == (2, 20)
    for row, first in ((0, 0), (1, 4)):
        ids = set(kept[row].tolist())
        assert {first, first + 1, first + 2} <= ids
        assert set(range(45, 50)) <= ids  # ceil(0.25 · 20) = 5 recent
        assert 10 in ids
        assert not ({0, 1, 2, 3} & ids) or row == 0


def test_breakpoint_keeps_fewer_when_mass_is_concentrated():
    policy = get_policy("lethe", budget=30, sinks=1, recent_ratio=0.1, tau=0.9)
    policy.bind(None, type("Config", (), {"num_hidden_layers": 1})())
    scores = torch.full((1, 60), 1e-4)
    scores[0, [7, 20, 33]] = 1.0  # three tokens hold almost all the mass
    kept = policy._keep(scores, torch.ones(1, 60, dtype=torch.bool), 30)
    ids = set(kept[0].tolist())
    assert {7, 20, 33} <= ids and kept.shape[1] < 30


def test_beam_search_is_refused_with_one_line():
    model = tiny_model("llama", layers=2, heads=2, kv_heads=1)
    ids, mask = padded(1, 20)
    with attach(model, None, "lethe", budget=8) as session, pytest.raises(ValueError, match="num_beams=1"):
        session.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=2, pad_token_id=259)


@pytest.mark.parametrize("seed", range(6))
def test_eviction_on_the_device_equals_the_reference(seed):
    """keep_on_device (the engine's, fixed shapes) against Lethe._keep (the reference, row by row) on slots with
    holes (already evicted), left padding, ragged choices (a breakpoint that keeps fewer in one row) and ties."""
    from rolecall.runtime.policies.lethe import keep_on_device

    g = torch.Generator().manual_seed(seed)
    b, s, cap = 3, 60, 24
    policy = get_policy("lethe", budget=cap, sinks=2, recent_ratio=0.2, segments=3, tau=(0.6, 0.9, 1.0)[seed % 3])
    held = torch.rand(b, s, generator=g) < 0.8
    n = int(held.sum(-1).min())
    held &= held.cumsum(-1) <= n  # every row holds as many slots, as in a cache
    held[:, -1] = True
    held &= held.cumsum(-1) <= n
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :7] = False  # left padding
    scores = torch.rand(b, s, generator=g) ** 4
    scores[2] = scores[2] * 0.01
    scores[2, 30] = 5.0  # mass concentrated: the breakpoint keeps fewer there
    scores[0, 10:14] = 0.25  # ties
    got = keep_on_device(scores, valid, held, cap, policy.sinks, policy.recent_slots(cap), policy.segments, policy.tau)
    slots = torch.stack([row.nonzero().flatten() for row in held])  # [B, n] the reference's compact list
    kept = policy._keep(scores.gather(1, slots), valid.gather(1, slots), cap)  # [B, n'] positions in that list
    want = torch.zeros_like(held).scatter_(1, slots.gather(1, kept), True)
    assert torch.equal(got, want)


def test_engine_holds_lethe_layers_in_compact_buffers_of_bounded_size():
    """On the engine a Lethe layer's buffer holds the prompt and one slot until its first step, and capacity + 1
    slots from then on, however many tokens are generated; full attention's cache grows with them. The step
    has no full fallback to hide behind."""
    from rolecall.runtime.engine import StaticDecoder, Weights
    from rolecall.runtime.engine.generate import generate
    from rolecall.runtime.policies.full import Full

    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    weights = Weights.from_model(model, positions=512)
    policy = get_policy("lethe", budget=24, sinks=2, recent_ratio=0.2)
    policy.bind(None, model.config)
    prompt = [list(range(1, 31))]  # 30 tokens
    per_slot = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16 float32 values
    for new in (8, 200):
        out = generate(weights, policy, prompt, max_new_tokens=new, kernels="naive")
        assert len(out.tokens[0]) == new
        assert out.info["cache_bytes"] == 4 * (24 + 1) * per_slot  # every layer: capacity + 1 slots
        dense = generate(weights, Full(), prompt, max_new_tokens=new, kernels="naive")
        assert dense.info["cache_bytes"] == 4 * (30 + new) * per_slot
    with pytest.raises(ValueError, match="runs its own step from the first token"):
        StaticDecoder(weights, policy, 1, 64, min_context=32, kernels="naive")


def test_a_length_past_the_compact_buffer_is_a_steady_state_for_benchmarks():
    """set_length beyond a Lethe layer's buffer (a benchmark's random cache) holds the most recent positions,
    and the step then runs at that buffer's size: positions stay in order and the new token is kept."""
    from rolecall.runtime.engine import StaticDecoder, Weights

    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    weights = Weights.from_model(model, positions=512)
    policy = get_policy("lethe", budget=24, sinks=2, recent_ratio=0.2)
    policy.bind(None, model.config)
    dec = StaticDecoder(weights, policy, 2, 200, min_context=0, kernels="naive", prompt_tokens=0)
    assert all(k.shape[2] == 25 for k in dec.cache.k)  # capacity + 1 slots per layer
    dec.cache.fill_random()
    dec.set_length(100)
    step = dec.static
    assert int(step.count[0]) == 24 and step.pos[0][0, :24].tolist() == list(range(76, 100))
    for t in range(3):
        dec.step(torch.tensor([5, 7]))
        for i in step.caps:
            held = int(step.count[i])
            pos = step.pos[i][:, :held]
            assert held <= 24 and (pos.diff(dim=-1) > 0).all() and (pos[:, -1] == 100 + t).all()


def test_compiled_eviction_equals_the_eager_step():
    """The eviction as the GPU decoder runs it (one torch.compile graph, no graph break, buffers changed in
    place) gives the same logits and the same held positions as the eager step over many evicting steps, at two
    capacities (the second compiles with the shapes symbolic)."""
    from rolecall.runtime.engine import StaticDecoder, Weights
    from rolecall.runtime.policies.lethe import evict

    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    weights = Weights.from_model(model, positions=512)
    torch._dynamo.reset()
    for budget in (20, 24):
        policy = get_policy("lethe", budget=budget, sinks=2, recent_ratio=0.2)
        policy.bind(None, model.config)
        runs = []
        for compiled in (False, True):
            dec = StaticDecoder(weights, policy, 2, 120, min_context=0, kernels="naive", prompt_tokens=0)
            if compiled:
                dec.static._compiled = torch.compile(evict, backend="aot_eager", fullgraph=True)
            dec.cache.fill_random(seed=3)
            dec.set_length(40)
            logits = torch.stack([dec.step(torch.tensor([5 + t, 7])).clone() for t in range(12)])
            runs.append((logits, [dec.static.pos[i].clone() for i in sorted(dec.static.caps)]))
        assert torch.allclose(runs[0][0], runs[1][0], atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_compaction_order_is_a_stable_sort_of_the_dropped_slots():
    from rolecall.runtime.policies.lethe import compaction_order

    g = torch.Generator().manual_seed(3)
    for width in (1, 2, 7, 64):
        keep = torch.rand(5, width, generator=g) < torch.tensor([0.0, 0.3, 0.5, 0.9, 1.0])[:, None]
        expected = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
        assert torch.equal(compaction_order(keep), expected), width


def test_after_its_first_step_lethe_settles_into_capacity_plus_one_slots():
    """Past a prompt longer than the capacity, the first step reads the whole prompt-sized buffer and evicts;
    then each layer's buffers are replaced by capacity + 1 slots (the prompt-sized ones freed), every later
    step reads only those, and the logits and held positions equal those of the step kept over the large
    buffers. A prompt within the capacity settles before its first step, with nothing to shrink."""
    import weakref

    from rolecall.runtime.engine import StaticDecoder, Weights

    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    weights = Weights.from_model(model, positions=512)
    policy = get_policy("lethe", budget=24, sinks=2, recent_ratio=0.2)
    policy.bind(None, model.config)
    ids = torch.randint(1, 200, (2, 60), generator=torch.Generator().manual_seed(0))
    runs = []
    for settles in (True, False):
        dec = StaticDecoder(weights, policy, 2, 80, min_context=0, kernels="naive", prompt_tokens=60)
        if not settles:
            dec.static.settle = lambda dec: False
        widths: list[int] = []

        def attend(q, k, v, *a, _attend=dec.attn.attend, _widths=widths, **kw):
            _widths.append(k.shape[2])
            return _attend(q, k, v, *a, **kw)

        dec.attn.attend = attend
        dec.prefill(ids)
        prompt_sized = [weakref.ref(t) for t in dec.cache.k + dec.cache.v]
        logits = []
        for t in range(10):
            widths.clear()
            logits.append(dec.step().clone())
            if settles:
                assert widths == ([61] * 4 if t == 0 else [25] * 4), (t, widths)
        if settles:
            assert dec.cache.nbytes == 2 * 4 * 2 * 2 * 25 * 16 * 4  # K, V × 4 layers × 2 rows × 2 heads × 25 slots
            assert all(r() is None for r in prompt_sized)  # freed
        runs.append((torch.stack(logits), [dec.static.pos[i][:, :25].clone() for i in sorted(dec.static.caps)]))
    torch.testing.assert_close(runs[0][0], runs[1][0], atol=1e-5, rtol=1e-5)  # sums over other widths
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))

    short = StaticDecoder(weights, policy, 2, 80, min_context=0, kernels="naive")  # buffers of every slot
    short.prefill(ids[:, :20])
    assert short._settle_at == 20  # 20 slots held, within the capacity: settles at its first step
    short.step()
    assert all(k.shape[2] == 25 for k in short.cache.k)


def test_a_finished_lethe_decoder_frees_its_buffers_without_the_garbage_collector():
    """A decoder's Lethe step (with its compiled eviction) forms no reference cycle, so the cache
    buffers go as soon as the decoder does; an evaluation makes one decoder per batch, and buffers left to the
    collector piled up to an out-of-memory error at 32K × 32 on an H200."""
    import gc
    import weakref

    from rolecall.runtime.engine import StaticDecoder, Weights
    from rolecall.runtime.policies.lethe import evict

    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    weights = Weights.from_model(model, positions=512)
    policy = get_policy("lethe", budget=24, sinks=2, recent_ratio=0.2)
    policy.bind(None, model.config)
    gc.disable()
    try:
        dec = StaticDecoder(weights, policy, 2, 80, min_context=0, kernels="naive", prompt_tokens=60)
        dec.prefill(torch.randint(1, 200, (2, 60), generator=torch.Generator().manual_seed(0)))
        for _ in range(3):
            dec.step()
        dec.static._compiled = dec.compiled(evict)  # what a compiling decoder keeps
        buffers = [weakref.ref(t) for t in dec.static.buffers]
        steps = [weakref.ref(dec.static)]
        del dec
        assert all(r() is None for r in buffers + steps)
    finally:
        gc.enable()


def test_a_budget_below_the_sinks_still_keeps_one_token_chosen_by_score():
    """budget=1 with two sinks: a layer holds at least the sinks, the current token and one more, which its
    scores choose. Ten slots, slot 5 the best other token, no recent share: kept 0, 1 (sinks), 5 and 9 (current)."""
    policy = get_policy("lethe", budget=1, sinks=2, recent_ratio=0.0, segments=1)
    policy.bind(None, type("Config", (), {"num_hidden_layers": 1})())
    scores = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.1, 0.9, 0.2, 0.1, 0.3, 0.0]])
    kept = policy._keep(scores, torch.ones(1, 10, dtype=torch.bool), policy.capacity(0, 10))
    assert kept.tolist() == [[0, 1, 5, 9]]


def test_the_current_token_is_kept_whatever_its_score():
    """Five slots, one sink, no recent share, room for three: the sink, the current token (slot 4, score 0) and the
    best candidate (slot 1), on the reference and on the device alike."""
    from rolecall.runtime.policies.lethe import keep_on_device

    policy = get_policy("lethe", budget=3, sinks=1, recent_ratio=0.0, segments=1)
    scores = torch.tensor([[0.0, 5.0, 4.0, 3.0, 0.0]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    assert policy.recent_slots(3) == 0
    assert policy._keep(scores, valid, 3).tolist() == [[0, 1, 4]]
    got = keep_on_device(scores, valid, valid.clone(), 3, 1, 0, 1, policy.tau)
    assert got.tolist() == [[True, True, False, False, True]]
