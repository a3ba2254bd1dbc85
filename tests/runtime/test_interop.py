import json

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from rolecall.core.manifest import ManifestError, ManifestMismatchError, ModelIdentity, RoleManifest
from rolecall.core.manifest.interop import (
    duo_roles,
    export_manifest,
    import_manifest,
    merge_manifests,
    read_duo_gates,
    to_duo_gates,
)
from tests.tiny import tiny_config

CONFIG = tiny_config("llama", layers=4, heads=4, kv_heads=2)


def heads_manifest(gates=None, roles=None):
    g = torch.Generator().manual_seed(3)
    gates = torch.rand(4, 2, generator=g) if gates is None else gates
    roles = (gates > 0.5).to(torch.int8) if roles is None else roles
    return RoleManifest(ModelIdentity.from_config(CONFIG, name="tiny"), head_role=roles, head_expected_gate=gates,
                        head_alpha=torch.ones(4, 2), head_beta=torch.ones(4, 2))


def layers_manifest():
    return RoleManifest(ModelIdentity.from_config(CONFIG, name="tiny"), layer_role=[0, 1, 2, 1],
                        layer_shift=torch.tensor([0.0, 0.2, 0.1, 0.4]), layer_budget=torch.full((4,), 0.25))


def test_duo_round_trip_keeps_roles(tmp_path):
    ours = heads_manifest()
    export_manifest(ours, "duo", tmp_path / "duo")
    assert json.loads((tmp_path / "duo" / "config.json").read_text()) == {"sink_size": 64, "recent_size": 256}
    back = import_manifest(tmp_path / "duo", "duo", CONFIG)
    assert torch.equal(back.head_role[1:], ours.head_role[1:])
    assert bool(back.head_role[0].all())  # layer 0 always retrieval
    np.testing.assert_allclose(back.head_expected_gate.numpy(), ours.head_expected_gate.numpy())


def test_duo_round_trip_keeps_roles_chosen_by_exact_target(tmp_path):
    gates = torch.tensor([[0.9, 0.8], [0.7, 0.6], [0.55, 0.2], [0.1, 0.05]])
    roles = torch.tensor([[1, 1], [1, 0], [0, 0], [0, 0]], dtype=torch.int8)  # top 3, not gate > 0.5
    export_manifest(heads_manifest(gates, roles), "duo", tmp_path / "duo")
    assert torch.equal(import_manifest(tmp_path / "duo", "duo", CONFIG).head_role, roles)


def test_duoattention_layout_imports_onto_llama3_8b_shape(tmp_path):
    rng = np.random.default_rng(0)
    gates = rng.random((32, 8))
    (tmp_path / "pattern").mkdir()
    np.savetxt(tmp_path / "pattern" / "full_attention_heads.tsv", gates, delimiter="\t")
    llama3 = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                         intermediate_size=14336, vocab_size=128256)
    m = import_manifest(tmp_path / "pattern", "duo", llama3, name="llama3-8b-1048k", sparsity=0.5)
    assert m.head_role.shape == (32, 8) and m.model.num_kv_heads == 8
    expected = (gates >= np.sort(gates.reshape(-1))[128]).astype(np.int8)  # top half by gate
    expected[0] = 1
    assert np.array_equal(m.head_role.numpy(), expected)
    m.validate_for(llama3)
    with pytest.raises(ManifestMismatchError, match="32 layers × 8 KV heads but the model has 4 × 2"):
        import_manifest(tmp_path / "pattern", "duo", CONFIG)


def test_duo_rules_match_brute_force():
    gates = np.array([[0.2, 0.9, 0.4], [0.6, 0.1, 0.75]])
    assert duo_roles(gates).tolist() == [[0, 1, 0], [1, 0, 1]]
    assert duo_roles(gates, threshold=0.65).tolist() == [[0, 1, 0], [0, 0, 1]]
    assert duo_roles(gates, num_retrieval=2).tolist() == [[0, 1, 0], [0, 0, 1]]
    assert duo_roles(gates, sparsity=0.5).tolist() == [[0, 1, 0], [1, 0, 1]]
    with pytest.raises(ValueError, match="sparsity must be in"):
        duo_roles(gates, sparsity=1.5)


def test_duo_sparsity_rounds_the_retrieval_count_to_the_nearest_head():
    # 1 − 0.48 of 5 heads is 2.6 heads: the 3 largest gates (0.9, 0.7, 0.5), not 2
    gates = np.array([[0.1, 0.9, 0.3, 0.7, 0.5]])
    assert duo_roles(gates, sparsity=0.48).tolist() == [[0, 1, 0, 1, 1]]


def test_duo_export_keeps_gates_of_exactly_one_half_on_the_sparse_side():
    # heads.role is "gate > 0.5", so a gate of 0.5 is sparse and the gates themselves reproduce the roles
    gates = torch.tensor([[0.5, 0.8], [0.2, 0.9], [0.5, 0.1], [0.6, 0.4]])
    assert to_duo_gates(heads_manifest(gates)).tolist() == gates.tolist()


def test_bad_tsv_is_refused(tmp_path):
    (tmp_path / "a.tsv").write_text("0.1\t0.2\n0.3\n")
    with pytest.raises(ManifestError, match="different lengths"):
        read_duo_gates(tmp_path / "a.tsv")
    (tmp_path / "b.tsv").write_text("0.1\tabc\n")
    with pytest.raises(ManifestError, match="tab-separated numbers"):
        read_duo_gates(tmp_path / "b.tsv")
    with pytest.raises(OSError, match="no such file"):
        read_duo_gates(tmp_path / "missing")


def test_a_file_that_is_not_a_json_object_is_refused_in_one_line(tmp_path):
    (tmp_path / "text.json").write_text("# a layer list\n[0, 1]\n")
    with pytest.raises(ManifestError, match=r"^JSON manifest .*text.json: not valid JSON \(Expecting value at line 1\); "
                                            "give the JSON that rolecall export --format json writes$"):
        import_manifest(tmp_path / "text.json", "json", CONFIG)
    (tmp_path / "list.json").write_text("[0, 1]")
    with pytest.raises(ManifestError, match=r"^layer list .*list.json: expected a JSON object, got list; give a layer "
                                            r"list as rolecall export --format layers writes it"):
        import_manifest(tmp_path / "list.json", "layers", CONFIG)
    (tmp_path / "bytes.json").write_bytes(bytes([0xFF, 0xFE, 0x00, 0x81]))
    with pytest.raises(ManifestError, match="bytes.json: not a text file; give a layer list"):
        import_manifest(tmp_path / "bytes.json", "layers", CONFIG)
    with pytest.raises(ManifestError, match=r"^JSON manifest .*absent.json: no such file; give the JSON that rolecall "
                                            "export --format json writes$"):
        import_manifest(tmp_path / "absent.json", "json", CONFIG)
    with pytest.raises(ManifestError, match=r"^layer list .*: a folder; give a layer list"):
        import_manifest(tmp_path, "layers", CONFIG)


def test_json_round_trip_is_lossless(tmp_path):
    merged = merge_manifests(layers_manifest(), heads_manifest())
    export_manifest(merged, "json", tmp_path / "m.json")
    back = import_manifest(tmp_path / "m.json", "json", CONFIG)
    assert back.to_bytes() == merged.to_bytes()
    with pytest.raises(ManifestMismatchError, match="num_layers"):
        import_manifest(tmp_path / "m.json", "json", tiny_config("llama", layers=6, heads=4, kv_heads=2))


def test_layer_list_round_trip(tmp_path):
    ours = layers_manifest()
    export_manifest(ours, "layers", tmp_path / "l.json")
    doc = json.loads((tmp_path / "l.json").read_text())
    assert doc["full_attention_layers"] == [0, 1, 3] and doc["token_selection_layers"] == [1, 3]
    assert torch.equal(import_manifest(tmp_path / "l.json", "layers", CONFIG).layer_role, ours.layer_role)
    with pytest.raises(ManifestError, match="no layers section"):
        export_manifest(heads_manifest(), "layers", tmp_path / "x.json")


def test_merge_keeps_each_inputs_metrics_config_and_data_under_its_section():
    heads, layers = heads_manifest(), layers_manifest()
    heads.metrics, heads.config, heads.data = {"steps": 7, "gate": "hardkuma"}, {"lr": 0.02}, {"source": "pg"}
    layers.metrics, layers.data = {"recall_mean": 0.88, "drift": [0.1, 0.2]}, {"traces": 8}
    merged = merge_manifests(heads, layers)
    assert merged.metrics == {"layers": layers.metrics, "heads": heads.metrics}
    assert merged.config == {"layers": {}, "heads": heads.config}
    assert merged.data == {"layers": layers.data, "heads": heads.data}
    again = RoleManifest.from_bytes(merged.to_bytes())
    assert again.metrics == merged.metrics and again.to_bytes() == merge_manifests(layers, heads).to_bytes()


def test_merge_combines_and_refuses():
    merged = merge_manifests(heads_manifest(), layers_manifest())
    assert merged.sections == ["layers", "heads"]
    assert merged.delta_layers == [1, 3] and torch.equal(merged.head_role, heads_manifest().head_role)
    with pytest.raises(ManifestError, match="both manifests have a layers section"):
        merge_manifests(layers_manifest(), layers_manifest())
    other = RoleManifest(ModelIdentity.from_config(tiny_config("llama", layers=4, heads=4, kv_heads=1)),
                         head_role=torch.ones(4, 1, dtype=torch.int8))
    with pytest.raises(ManifestMismatchError, match="num_kv_heads is 2 and 1"):
        merge_manifests(layers_manifest(), other)


@pytest.mark.parametrize("gates, rule, roles", [
    # gate > threshold, strictly: a gate exactly at the threshold is not retrieval
    ([[0.5, 0.6], [0.4, 0.5]], {}, [[0, 1], [0, 0]]),
    ([[0.25, 0.2500001], [0.2499999, 1.0]], {"threshold": 0.25}, [[0, 1], [0, 1]]),
    ([[0.0, 1.0], [1.0, 0.0]], {"threshold": 1.0}, [[0, 0], [0, 0]]),
    ([[0.0, 1.0], [1.0, 0.0]], {"threshold": 0.0}, [[0, 1], [1, 0]]),
    # top-k: ties go to the earlier head; none and all at the ends
    ([[0.5, 0.5], [0.5, 0.5]], {"num_retrieval": 3}, [[1, 1], [1, 0]]),
    ([[0.3, 0.7], [0.7, 0.1]], {"num_retrieval": 1}, [[0, 1], [0, 0]]),
    ([[0.3, 0.7], [0.7, 0.1]], {"num_retrieval": 0}, [[0, 0], [0, 0]]),
    ([[0.3, 0.7], [0.7, 0.1]], {"num_retrieval": 4}, [[1, 1], [1, 1]]),
    # the 1 − sparsity share of the heads, at sparsity 0, 1 and a share that is a whole number of heads
    ([[0.3, 0.7], [0.7, 0.1]], {"sparsity": 0.0}, [[1, 1], [1, 1]]),
    ([[0.3, 0.7], [0.7, 0.1]], {"sparsity": 1.0}, [[0, 0], [0, 0]]),
    ([[0.3, 0.7], [0.7, 0.1]], {"sparsity": 0.75}, [[0, 1], [0, 0]]),
])
def test_duo_rules_at_their_ends(gates, rule, roles):
    assert duo_roles(np.array(gates), **rule).tolist() == roles
