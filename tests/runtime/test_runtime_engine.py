"""attach(): every policy equals dense decoding when it has nothing to drop, and the model is restored."""

import pytest
import torch

from rolecall.core.manifest import ManifestMismatchError, ModelIdentity, RoleManifest
from rolecall.runtime import attach
from rolecall.runtime.policies import PolicyError, UnknownPolicyError
from tests.tiny import tiny_model

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


pytestmark = pytest.mark.usefixtures("one_thread")


GEN = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=259)


def manifest_for(model, layer_role=None, head_role=None, layer_budget=None):
    def t(x, dtype):
        return None if x is None else torch.tensor(x, dtype=dtype)

    return RoleManifest(ModelIdentity.from_config(model.config), layer_role=t(layer_role, torch.int8),
                        head_role=t(head_role, torch.int8), layer_budget=t(layer_budget, torch.float32))


def batch(size, length=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (size, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, size):  # left padding of different lengths
        mask[row, : 7 * row] = 0
    return ids, mask


def decode_logits(model, ids, mask, session=None):
    if session is None:
        return model.generate(input_ids=ids, attention_mask=mask, **GEN).logits
    return session.generate(input_ids=ids, attention_mask=mask, **GEN).logits


def assert_close(got, want, rtol=1e-4):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert float((a - b).abs().max()) <= rtol * float(b.abs().max()), float((a - b).abs().max())


# (policy, manifest builder, params): each has nothing to drop on a 48-token prompt.
CASES = [
    ("full", None, {}),
    ("delta", "all_full", {}),
    ("delta", "delta", {"budget": 1024}),
    ("lychee", "all_retrieval", {}),
    ("lychee", "mixed_heads", {"budget": 4096}),
    ("lychee", "mixed_heads", {"ratio": 1.0, "block_size": 16}),
    ("lethe", None, {"sparse_ratio": 1.0}),
    ("lethe", "budget", {"budget": 4096}),
    ("vattention", "all_full", {}),
    ("vattention", None, {"window": 4096}),
]


def build(model, kind):
    layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    return {
        None: None,
        "all_full": manifest_for(model, layer_role=[0] * layers),
        "delta": manifest_for(model, layer_role=[0, 1, 2, 2]),
        "all_retrieval": manifest_for(model, head_role=[[1] * kv] * layers),
        "mixed_heads": manifest_for(model, head_role=[[1, 1], [0, 1], [0, 0], [1, 0]]),
        "budget": manifest_for(model, layer_budget=[1.0, 0.5, 0.25, 0.25]),
    }[kind]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_policy_equals_dense_when_nothing_is_dropped(family):
    model = tiny_model(family, layers=4, heads=4, kv_heads=2, head_dim=16)
    for size in (1, 3):
        ids, mask = batch(size)
        want = decode_logits(model, ids, mask)
        for policy, kind, params in CASES:
            with attach(model, build(model, kind), policy, **params) as session:
                got = decode_logits(model, ids, mask, session)
            assert_close(got, want)
            assert session.stats.steps[0] == GEN["max_new_tokens"] - 1  # the first token comes from prefill


def test_sparse_policy_changes_logits_and_exit_restores_model():
    model = tiny_model("llama", layers=4, heads=4, kv_heads=2, head_dim=16)
    ids, mask = batch(3, length=120)
    before = decode_logits(model, ids, mask)
    impl = model.config._attn_implementation
    with attach(model, manifest_for(model, layer_role=[0, 1, 2, 2]), "delta", num_pages=1, recent_pages=1,
                page_size=4) as session:
        inside = decode_logits(model, ids, mask, session)
        assert model.config._attn_implementation == "rolecall_delta"
    assert max(float((a - b).abs().max()) for a, b in zip(inside, before)) > 1e-2  # the policy did act
    assert model.config._attn_implementation == impl
    assert_close(decode_logits(model, ids, mask), before, rtol=0)
    with pytest.raises(RuntimeError), attach(model, None, "full"):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == impl
    assert_close(decode_logits(model, ids, mask), before, rtol=0)


def test_attended_fraction_of_delta_is_the_page_budget():
    # 2 of 4 layers read 2 pages of 4 tokens out of T tokens; the other two read everything.
    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16)
    ids, mask = batch(1, length=63)
    with attach(model, manifest_for(model, layer_role=[0, 1, 2, 2]), "delta", num_pages=2, recent_pages=1,
                page_size=4) as session:
        session.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=259)
    fractions = session.stats.attended_fraction()
    assert fractions[0] == fractions[1] == 1.0
    assert fractions[2] == pytest.approx(8 / 64) and fractions[3] == pytest.approx(8 / 64)


def test_nested_attach_is_refused():
    model = tiny_model("llama", layers=2, heads=2, kv_heads=1)
    with attach(model, None, "full"), pytest.raises(PolicyError, match="already runs rolecall"), \
            attach(model, None, "full"):
        pass


@pytest.mark.parametrize("policy,params,manifest,match", [
    ("dense", {}, None, "known policies: full, delta, lychee, lethe, vattention"),
    ("delta", {}, None, "needs a manifest with a layers section"),
    ("delta", {"budget": 0}, "delta", "budget must be a number > 0"),
    ("delta", {"num_pages": -3}, "delta", "num_pages must be"),
    ("lychee", {}, "delta", "needs a manifest with a heads section"),
    ("lychee", {"budget": 10, "ratio": 0.1}, None, "give one of budget, ratio"),
    ("lychee", {"ratio": 1.5}, None, "ratio is a fraction"),
    ("lethe", {}, None, "needs a manifest with layers.budget"),
    ("lethe", {"sparse_ratio": 0}, None, "sparse_ratio is a fraction"),
    ("vattention", {"epsilon": 0}, None, "epsilon must be in"),
    ("vattention", {"pages": 3}, None, "its parameters are"),
])
def test_bad_input_is_one_line_value_error(policy, params, manifest, match):
    model = tiny_model("llama", layers=4, heads=4, kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=match) as info, attach(model, build(model, manifest), policy, **params):
        pass
    assert "\n" not in str(info.value)
    assert isinstance(info.value, (PolicyError, UnknownPolicyError))


def test_delta_refuses_sparse_layers_before_any_delta_layer():
    model = tiny_model("llama", layers=4, heads=4, kv_heads=2, head_dim=16)
    with pytest.raises(PolicyError, match=r"sparse layers \[1\] come before"), \
            attach(model, manifest_for(model, layer_role=[0, 2, 1, 2]), "delta"):
        pass


def test_manifest_for_another_model_is_refused():
    model = tiny_model("llama", layers=4, heads=4, kv_heads=2, head_dim=16)
    other = tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=16)
    with pytest.raises(ManifestMismatchError, match="num_layers"), \
            attach(model, manifest_for(other, layer_role=[0, 1, 2]), "delta"):
        pass


def test_manifest_from_a_path(tmp_path):
    model = tiny_model("llama", layers=4, heads=4, kv_heads=2, head_dim=16)
    path = manifest_for(model, layer_role=[0, 1, 2, 2]).save(tmp_path / "m.safetensors")
    with attach(model, str(path), "delta") as session:
        assert session.manifest.delta_layers == [1]


def test_sliding_window_layers_keep_their_own_attention():
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    model = tiny_model("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16, layer_types=types,
                       use_sliding_window=True, sliding_window=8)
    assert model.config.layer_types == types
    ids, mask = batch(3, length=40)
    want = decode_logits(model, ids, mask)
    with attach(model, manifest_for(model, layer_role=[1, 2, 2, 2]), "delta", num_pages=64) as session:
        got = decode_logits(model, ids, mask, session)
    assert_close(got, want)  # the sliding layers still see only their window
    assert [s > 0 for s in session.stats.steps] == [True, False, True, False]
