"""Hybrid sliding-window models (Gemma 3): sliding layers keep their own attention everywhere.

The tiny hybrid (``tests.tiny``, family ``gemma3``) has sliding layers 0, 1, 3, 4 (window 8) and full-attention
layers 2 and 5; prompts are longer than the window, so a sliding layer that read everything would differ.
"""

from types import SimpleNamespace

import pytest
import torch

from rolecall import calibrate, train
from rolecall.calibrate.stats import cosine_shift
from rolecall.core.manifest import ManifestMismatchError, ModelIdentity, RoleManifest
from rolecall.core.models import sliding_layers
from rolecall.runtime import attach
from rolecall.runtime.policies import get_policy
from rolecall.train.config import TrainConfig
from rolecall.train.gates import GateParameters
from rolecall.train.hybrid import GateLayout
from tests.tiny import tiny_config, tiny_model, tiny_tokenizer

SLIDING, FULL = [0, 1, 3, 4], [2, 5]
L, KV = 6, 2


@pytest.fixture(scope="module")
def model():
    return tiny_model("gemma3", layers=L, heads=4, kv_heads=KV)


def _traces(n=2, length=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


# -- one source of truth --------------------------------------------------------------------------------------
def test_sliding_layers_from_layer_types_pattern_and_uniform_windows():
    assert sliding_layers(tiny_config("gemma3", layers=L)) == SLIDING
    assert sliding_layers(tiny_model("gemma3", layers=L)) == SLIDING  # a model works too
    old = SimpleNamespace(num_hidden_layers=7, sliding_window=512, sliding_window_pattern=3)
    assert sliding_layers(old) == [0, 1, 3, 4, 6]
    assert sliding_layers(tiny_config("mistral")) == []  # a window on every layer is not hybrid
    assert sliding_layers(tiny_config("llama")) == []


def test_manifest_records_sliding_layers_and_old_manifests_still_load(model, tmp_path):
    m = RoleManifest(model=ModelIdentity.from_config(model), layer_role=torch.zeros(L, dtype=torch.int8))
    assert m.model.sliding_layers == SLIDING
    assert m.metadata()["model.sliding_layers"] == "0,1,3,4"
    back = RoleManifest.load(m.save(tmp_path / "m.safetensors"))
    assert back.model.sliding_layers == SLIDING and back.equals(m)
    # a model without sliding layers writes no key, so its manifests keep their bytes; files without it load
    plain = RoleManifest(model=ModelIdentity.from_config(tiny_config("llama")), layer_role=torch.zeros(4, dtype=torch.int8))
    assert "model.sliding_layers" not in plain.metadata()
    assert RoleManifest.from_bytes(plain.to_bytes()).model.sliding_layers is None
    m.model.sliding_layers = [0, 1]
    with pytest.raises(ManifestMismatchError, match="sliding_layers"):
        m.validate_for(model, strict=False)


# -- calibration ----------------------------------------------------------------------------------------------
def _calibrate(model, **kw):
    config = dict(stride=4, min_context=16, page_size=4, num_pages=3, recent_pages=1, warmup=0, num_delta=2,
                  min_gap=1, bins=2)
    config.update(kw)
    return calibrate.run(model, tiny_tokenizer(), _traces(), config, progress=False)


def _reference_shift(model, traces, pairs, min_context=16, stride=4):
    """Mean 1 − cos(a[s], a[l]) over the sampled queries, from eager attention probabilities."""
    model.set_attn_implementation("eager")
    try:
        sums = {pair: 0.0 for pair in pairs}
        count = 0
        for ids in traces:
            with torch.no_grad():
                att = model(torch.tensor([ids]), output_attentions=True).attentions  # L × [1, Hq, T, T]
            q = torch.arange(min_context, len(ids), stride)
            a = [x[0].amax(0)[q] for x in att]  # L × [Q, T]
            for s, layer in pairs:
                sums[(s, layer)] += float(cosine_shift(a[s], a[layer]).sum())
            count += len(q)
    finally:
        model.set_attn_implementation("sdpa")
    return {pair: v / count for pair, v in sums.items()}


@pytest.mark.parametrize("select", ["peaks", "recall"])
def test_calibration_never_picks_a_sliding_layer(model, select):
    m = _calibrate(model, select=select)
    assert m.delta_layers == FULL
    assert m.layer_role.tolist() == [0, 0, 1, 0, 0, 1]
    assert m.layer_budget[SLIDING].tolist() == [1.0] * 4  # no budgets: the window is the budget
    assert m.metrics["sliding_layers"] == SLIDING and m.model.sliding_layers == SLIDING
    with pytest.raises(ValueError, match=r"--num-delta 3 is more than the 2 layers to select from \(6 layers less 4 "
                       r"sliding-window\); pass --num-delta N with 1 <= N <= 2"):
        _calibrate(model, num_delta=3, select=select)


def test_shift_is_taken_between_consecutive_full_attention_layers(model):
    m = _calibrate(model, num_delta=1)
    ref = _reference_shift(model, _traces(), [(2, 5)])
    assert m.layer_shift[SLIDING + [2]].tolist() == [0.0] * 5  # nothing recorded / no earlier full layer
    assert float(m.layer_shift[5]) == pytest.approx(ref[(2, 5)], abs=1e-4)
    assert m.layer_role.tolist() == [0, 0, 1, 0, 0, 2]


def test_include_sliding_records_and_chooses_every_layer(model):
    m = _calibrate(model, include_sliding=True, num_delta=4, select="recall")
    assert len(m.delta_layers) == 4 and set(m.delta_layers) & set(SLIDING)
    assert "sliding_layers" not in m.metrics
    ref = _reference_shift(model, _traces(), [(i - 1, i) for i in range(1, L)])
    for i in range(1, L):
        assert float(m.layer_shift[i]) == pytest.approx(ref[(i - 1, i)], abs=1e-4)
    # chunked prefill keeps every key of the sliding layers, so the numbers do not depend on the chunk size
    chunked = _calibrate(model, include_sliding=True, num_delta=4, select="recall", chunk_size=20)
    assert torch.allclose(chunked.layer_shift, m.layer_shift, atol=1e-5)


# -- runtime --------------------------------------------------------------------------------------------------
def _manifest(model, roles, budget=None, heads=None):
    return RoleManifest(model=ModelIdentity.from_config(model), layer_role=torch.tensor(roles, dtype=torch.int8),
                        layer_budget=budget, head_role=heads)


def _logits(model, ids, manifest=None, policy=None, steps=6, **params):
    def run(m):
        out = m.generate(ids, max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=259)
        return torch.stack(out.logits, 1), out.sequences

    if policy is None:
        return run(model), None
    with attach(model, manifest, policy, **params) as session:
        return run(session), session.summary()


HEADS = torch.tensor([[0, 0], [0, 0], [1, 1], [0, 0], [0, 0], [0, 1]], dtype=torch.int8)
BUDGET = torch.tensor([1, 1, 0.3, 1, 1, 0.6])


@pytest.mark.parametrize("policy, params", [
    ("full", {}), ("delta", {"budget": 256}), ("lychee", {"budget": 256}), ("lethe", {"budget": 256}),
    ("vattention", {}),
])
def test_every_policy_equals_dense_when_the_budget_covers_the_context(model, policy, params):
    ids = torch.tensor([_traces(1, 40, seed=3)[0]])
    (dense, seq), _ = _logits(model, ids)
    m = _manifest(model, [0, 0, 1, 0, 0, 2], BUDGET, HEADS)
    (got, got_seq), summary = _logits(model, ids, m, policy, **params)
    assert torch.equal(got_seq, seq)
    assert torch.allclose(got, dense, atol=1e-4, rtol=1e-4)
    steps = [row["steps"] for row in summary["layers"]]
    assert [steps[i] for i in SLIDING] == [0] * 4  # sliding layers never reach the policy
    assert all(steps[i] > 0 for i in FULL)


def test_delta_looks_past_sliding_layers_for_the_nearest_selection(model):
    ids = torch.tensor([_traces(1, 40, seed=4)[0]])
    small = {"num_pages": 2, "recent_pages": 1, "page_size": 4}
    (dense, _), _ = _logits(model, ids)
    (ref, _), _ = _logits(model, ids, _manifest(model, [0, 0, 1, 0, 0, 2]), "delta", **small)
    assert not torch.allclose(ref, dense, atol=1e-3)  # the budget is small enough to matter
    # roles on sliding layers (a manifest made with include_sliding) change nothing: a sliding "Δ-layer" at 3
    # neither selects nor hides layer 2's selection from layer 5, and sliding "sparse" layers 0, 1 are allowed
    (got, _), _ = _logits(model, ids, _manifest(model, [2, 2, 1, 1, 2, 2]), "delta", **small)
    assert torch.equal(got, ref)


def test_lethe_shares_budgets_over_full_attention_layers_only(model):
    policy = get_policy("lethe", budget=30)
    policy.bind(_manifest(model, [0] * L, torch.tensor([1, 1, 0.2, 1, 1, 0.4])), model.config)
    # mean over layers 2 and 5 is 0.3: 30 · 0.2 / 0.3 and 30 · 0.4 / 0.3 (over all six layers: 8 and 16)
    assert [policy.capacity(2, 1000), policy.capacity(5, 1000)] == [20, 40]


def test_lychee_first_full_layer_never_reads_a_stale_set(model):
    ids = torch.tensor([_traces(1, 40, seed=5)[0]])
    heads = HEADS.clone()
    heads[2] = 0  # not retrieval in the file: the runtime still makes the first full layer choose
    (a, _), _ = _logits(model, ids, _manifest(model, [0] * L, heads=heads), "lychee", budget=8)
    (b, _), _ = _logits(model, ids, _manifest(model, [0] * L, heads=HEADS), "lychee", budget=8)
    assert torch.equal(a, b)


def test_lychee_choices_pass_between_full_layers_only(model):
    from rolecall.runtime.policies.lychee import passes_on

    policy = get_policy("lychee", budget=8)
    policy.bind(_manifest(model, [0] * L, heads=HEADS), model.config)
    assert policy.policy_layers == [2, 5]  # the sliding layers never read a set
    # layer 2's head 0 passes its choice to layer 5's sparse head 0; head 1 to a retrieval head; layer 5 is last
    assert passes_on(policy.retrieval, policy.policy_layers).tolist() == [[False] * 2] * 2 + [[True, False]] + [
        [False] * 2] * 3


# -- training -------------------------------------------------------------------------------------------------
def test_gate_layout_holds_sliding_gates_open_and_out_of_expected_l0(model):
    layout = GateLayout.of(model)
    assert layout.held == [1, 2, 3, 4]  # sliding 1, 3, 4 and layer 2, the first full layer (nothing to inherit)
    gates = GateParameters("hardkuma", (L - 1, KV), fixed_open=layout.fixed_open(KV))
    dist = gates.distribution()
    z = dist.rsample((64,), generator=torch.Generator().manual_seed(0))
    assert bool((z[:, :4] == 1).all()) and not bool((z[:, 4] == 1).all())
    # α = β = 1: s is uniform, z = clamp(−0.1 + 1.2 s), so P(z = 0) = 1/12 for each learned gate
    assert float(dist.expected_l0().detach()) == pytest.approx(KV * 11 / 12, abs=1e-6)
    assert dist.expected_gate()[:4].tolist() == [[1.0] * KV] * 4
    assert layout.gated_heads(KV) == KV
    everything = GateLayout.of(model, include_sliding=True)
    assert everything.held == [] and everything.fixed_open(KV) is None and everything.gated_heads(KV) == (L - 1) * KV
    assert float(GateParameters("hardkuma", (L - 1, KV)).distribution().expected_l0().detach()) == pytest.approx(
        (L - 1) * KV * 11 / 12, abs=1e-6)


def _dataset(n=2, length=48):
    items = []
    for ids in _traces(n, length, seed=7):
        ids = torch.tensor(ids)
        labels = torch.full_like(ids, -100)
        labels[-6:] = ids[-6:]
        items.append({"input_ids": ids, "labels": labels})
    return items


def test_training_keeps_sliding_gates_at_one_and_does_not_count_them(model, tmp_path):
    config = TrainConfig(model="tiny", target=1, steps=3, checkpoint_every=10, prefill_chunk=20, lr=0.2,
                         lambda_lr=0.05, output=str(tmp_path / "h.safetensors"), plots=False)
    m = train.run(model, tiny_tokenizer(), _dataset(), config)
    ez = m.head_expected_gate
    assert ez[[1, 2, 3, 4]].tolist() == [[1.0] * KV] * 4
    assert m.head_role[SLIDING].sum() == 0 and m.head_role[2].tolist() == [1] * KV
    assert m.metrics["expected_l0"] <= KV + 1e-9  # only layer 5's two gates count
    assert m.metrics["retrieval_heads"] == int(m.head_role[5].sum())
    with pytest.raises(ValueError, match=f"exceeds the {KV} gated heads"):
        train.run(model, tiny_tokenizer(), _dataset(), TrainConfig(**{**config.to_dict(), "target": KV + 1}))

    wide = TrainConfig(**{**config.to_dict(), "include_sliding": True, "target": 4,
                          "output": str(tmp_path / "w.safetensors")})
    w = train.run(model, tiny_tokenizer(), _dataset(), wide)
    assert w.metrics["expected_l0"] > KV + 1  # the sliding layers' gates are learned and counted now
    assert not torch.equal(w.head_expected_gate[[1, 3, 4]], torch.ones(3, KV))


# -- the real hybrid model ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_gemma3_270m_loads_offline_and_knows_paris():
    from rolecall.core.models import load_model, load_tokenizer

    model, tok = load_model("gemma3-270m"), load_tokenizer("gemma3-270m")
    assert not hasattr(model.config, "quantization_config")
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.sliding_window) == (18, 1, 512)
    assert sliding_layers(model) == [i for i in range(18) if i not in (5, 11, 17)]
    assert tok("The capital of France is")["input_ids"] == [2, 818, 5279, 529, 7001, 563]
    with torch.no_grad():
        probs = model(**tok("The capital of France is", return_tensors="pt")).logits[0, -1].softmax(-1)
    # a 270M base model: " Paris" is among its top three here (after " the" and " a"), and first below
    assert tok.convert_tokens_to_ids("▁Paris") in probs.topk(3).indices.tolist()
    ids = tok("The Eiffel Tower is in the city of", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, ids["input_ids"].shape[1]:]).startswith(" Paris")
