"""The core's counts and choices at their exact ends, worked by hand: token ids at the last id of the vocabulary
and one past it (sequences counted from 1, empty ones skipped), sliding layers of a window pattern that divides
the layer count, DuoAttention roles with a gate exactly at the threshold, a retrieval count of 0 and of every
head, a quantile whose head count is a half (Python's round: halves go to the even count), ties (the earlier
head), the roles a manifest lists, paths reduced to file names, and config layers where a later one or a None
value meets an earlier one."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rolecall.core.configfile import ConfigError, layered
from rolecall.core.manifest import ManifestError, ModelIdentity, RoleManifest, portable_name
from rolecall.core.manifest.interop import duo_roles, to_duo_gates, to_layer_list
from rolecall.core.models import context_limit, sliding_layers
from rolecall.core.registry import Registry
from rolecall.core.tokens import TokenIdError, check_token_ids, vocab_size


# -- token ids ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sequences, vocab, says", [
    ([[0, 4]], 5, None),  # 0 and vocab − 1 are ids
    ([[5]], 5, "seq 1 has token id 5, the model's vocabulary has 5 ids \\(0-4\\)"),
    ([[], [5]], 5, "seq 2 has token id 5"),  # an empty sequence is skipped but still counted
    ([[4], [0], [3, 5]], 5, "seq 3 has token id 5"),
    ([torch.tensor([], dtype=torch.long), torch.tensor([4, 5])], 5, "seq 2 has token id 5"),
    ([[-1, 7]], 5, "seq 1 has token id -1"),  # a negative id is named before a too-large one
    ([[0], [-1]], None, "seq 2 has token id -1, but token ids are never negative"),
    ([[10 ** 6]], None, None),  # without a vocabulary only the sign is known
    ([[1]], 1, "seq 1 has token id 1, the model's vocabulary has 1 ids \\(0-0\\)"),
])
def test_token_ids_at_the_ends_of_the_vocabulary(sequences, vocab, says):
    if says is None:
        check_token_ids(sequences, vocab, "seq {n}")
    else:
        with pytest.raises(TokenIdError, match=f"^{says}"):
            check_token_ids(sequences, vocab, "seq {n}")


@pytest.mark.parametrize("config, size", [
    (SimpleNamespace(vocab_size=1), 1), (SimpleNamespace(vocab_size=0), None), (SimpleNamespace(vocab_size=None), None),
    (SimpleNamespace(), None),
    (SimpleNamespace(get_text_config=lambda: SimpleNamespace(vocab_size=7), vocab_size=9), 7),
])
def test_vocab_size_from_the_text_config(config, size):
    assert vocab_size(config) == size


@pytest.mark.parametrize("config, name, limit", [
    (SimpleNamespace(max_position_embeddings=1), None, 1),
    (SimpleNamespace(max_position_embeddings=0), None, None),
    (SimpleNamespace(max_position_embeddings=None), "smollm2-135m", 8192),  # the alias's context
    (SimpleNamespace(max_position_embeddings=0), "smollm2-135m", 8192),  # 0 says nothing either
    (SimpleNamespace(max_position_embeddings=4096), "smollm2-135m", 4096),  # the config wins
    (SimpleNamespace(), "no-such-alias", None),
])
def test_context_limit_from_the_config_then_the_alias(config, name, limit):
    assert context_limit(config, name) == limit


# -- sliding layers ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, layers", [
    ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}, [0, 2]),
    ({"layer_types": ["full_attention"] * 3}, []),
    # every pattern-th layer is full: (i + 1) divisible by the pattern
    ({"num_hidden_layers": 5, "sliding_window": 4, "sliding_window_pattern": 2}, [0, 2, 4]),
    ({"num_hidden_layers": 6, "sliding_window": 4, "sliding_window_pattern": 2}, [0, 2, 4]),
    ({"num_hidden_layers": 12, "sliding_window": 4, "sliding_window_pattern": 6}, [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]),
    ({"num_hidden_layers": 5, "sliding_window": 4, "sliding_window_pattern": 6}, [0, 1, 2, 3, 4]),
    ({"num_hidden_layers": 3, "sliding_window": 4, "_sliding_window_pattern": 3}, [0, 1]),
    # a pattern of 1 (every layer full), no window, or a window on every layer: not hybrid
    ({"num_hidden_layers": 4, "sliding_window": 4, "sliding_window_pattern": 1}, []),
    ({"num_hidden_layers": 4, "sliding_window": None, "sliding_window_pattern": 2}, []),
    ({"num_hidden_layers": 4, "sliding_window": 4}, []),
    # an empty layer_types says nothing: the pattern decides
    ({"layer_types": [], "num_hidden_layers": 4, "sliding_window": 4, "sliding_window_pattern": 2}, [0, 2]),
])
def test_sliding_layers_of_types_and_patterns(fields, layers):
    assert sliding_layers(SimpleNamespace(**fields)) == layers


# -- DuoAttention roles ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gates, rule, roles", [
    # gate > threshold, strictly
    ([[0.5, 0.5001, 0.4999, 1.0]], {}, [[0, 1, 0, 1]]),
    ([[0.0, 0.1, 1.0, 0.9]], {"threshold": 0.9}, [[0, 0, 1, 0]]),
    ([[0.0, 0.1, 1.0, 0.9]], {"threshold": 0.0}, [[0, 1, 1, 1]]),
    # top-n, ties to the earlier head, 0 and every head allowed
    ([[0.5, 0.5, 0.5, 0.2]], {"num_retrieval": 2}, [[1, 1, 0, 0]]),
    ([[0.2, 0.5, 0.5, 0.5]], {"num_retrieval": 1}, [[0, 1, 0, 0]]),
    ([[0.9, 0.1, 0.5, 0.7]], {"num_retrieval": 0}, [[0, 0, 0, 0]]),
    ([[0.9, 0.1, 0.5, 0.7]], {"num_retrieval": 4}, [[1, 1, 1, 1]]),
    ([[0.9, 0.1], [0.5, 0.7]], {"num_retrieval": 3}, [[1, 0], [1, 1]]),  # ranked over every (layer, head)
    # the 1 − sparsity share of the 4 heads, rounded to a count (halves to the even count)
    ([[0.9, 0.1, 0.5, 0.7]], {"sparsity": 0.0}, [[1, 1, 1, 1]]),
    ([[0.9, 0.1, 0.5, 0.7]], {"sparsity": 1.0}, [[0, 0, 0, 0]]),
    ([[0.9, 0.1, 0.5, 0.7]], {"sparsity": 0.3}, [[1, 0, 1, 1]]),  # 2.8 heads → 3
    ([[0.9, 0.1, 0.5, 0.7]], {"sparsity": 0.6}, [[1, 0, 0, 1]]),  # 1.6 → 2
    ([[0.9, 0.1, 0.5, 0.7]], {"sparsity": 0.375}, [[1, 0, 0, 1]]),  # 2.5 → 2
    ([[0.9, 0.1, 0.5, 0.7]], {"sparsity": 0.125}, [[1, 1, 1, 1]]),  # 3.5 → 4
    # a count given beside a sparsity wins
    ([[0.9, 0.1, 0.5, 0.7]], {"sparsity": 0.0, "num_retrieval": 1}, [[1, 0, 0, 0]]),
])
def test_duo_roles_at_their_ends(gates, rule, roles):
    assert duo_roles(np.array(gates), **rule).tolist() == roles


@pytest.mark.parametrize("count", [1, 11, 12, 13, 31, 32])
def test_duo_roles_break_ties_towards_the_earlier_head_among_many(count):
    """4 layers × 8 heads: every third head (by flat index) at 0.7, the rest at 0.5. The top ``count`` are the
    0.7 heads in order, then the 0.5 heads from the first on; a plain loop ranks them by (−gate, index)."""
    gates = np.full(32, 0.5)
    gates[::3] = 0.7
    ranked = sorted(range(32), key=lambda i: (-gates[i], i))[:count]
    want = [1 if i in ranked else 0 for i in range(32)]
    assert duo_roles(gates.reshape(4, 8), num_retrieval=count).reshape(-1).tolist() == want


@pytest.mark.parametrize("rule, says", [
    ({"num_retrieval": 5}, r"num_retrieval must be in \[0, 4\], got 5"),
    ({"num_retrieval": -1}, r"num_retrieval must be in \[0, 4\], got -1"),
    ({"sparsity": 1.0 + 1e-9}, "sparsity must be in"),
    ({"sparsity": -1e-9}, "sparsity must be in"),
])
def test_duo_roles_refuse_counts_past_the_heads(rule, says):
    with pytest.raises(ValueError, match=says):
        duo_roles(np.array([[0.9, 0.1, 0.5, 0.7]]), **rule)


def _heads(roles, gates=None) -> RoleManifest:
    t = torch.tensor
    return RoleManifest(ModelIdentity(2, 4, 2, 8), head_role=t(roles, dtype=torch.int8),
                        head_expected_gate=None if gates is None else t(gates))


@pytest.mark.parametrize("roles, gates, exported", [
    # gates whose 0.5 threshold gives the roles are exported as they are
    ([[1, 1], [0, 1]], [[1.0, 1.0], [0.5, 0.75]], [[1.0, 1.0], [0.5, 0.75]]),
    # a retrieval head at exactly 0.5 would read as sparse: the roles go out instead
    ([[1, 1], [1, 1]], [[1.0, 1.0], [0.5, 0.75]], [[1.0, 1.0], [1.0, 1.0]]),
    ([[1, 1], [0, 0]], None, [[1.0, 1.0], [0.0, 0.0]]),
])
def test_duo_gates_reproduce_the_roles_at_the_threshold(roles, gates, exported):
    got = to_duo_gates(_heads(roles, gates))
    assert got.tolist() == exported
    assert ((got > 0.5).astype(int) == np.array(roles)).all()


# -- the roles a manifest lists ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("roles, delta, full", [
    ([0, 0, 1, 2, 1], [2, 4], [0, 1, 2, 4]),
    ([1, 2, 2, 2, 2], [0], [0]),
    ([2, 2, 2, 2, 1], [4], [4]),
    ([0, 0, 0, 0, 0], [], [0, 1, 2, 3, 4]),
])
def test_delta_and_full_layers_of_a_manifest(roles, delta, full):
    m = RoleManifest(ModelIdentity(5, 4, 2, 8), layer_role=torch.tensor(roles, dtype=torch.int8))
    assert m.delta_layers == delta
    doc = to_layer_list(m)
    assert (doc["num_layers"], doc["full_attention_layers"], doc["token_selection_layers"]) == (5, full, delta)


@pytest.mark.parametrize("roles, heads", [
    ([[1, 0], [0, 1]], [(0, 0), (1, 1)]), ([[0, 0], [0, 0]], []), ([[1, 1], [1, 1]], [(0, 0), (0, 1), (1, 0), (1, 1)]),
])
def test_retrieval_heads_of_a_manifest(roles, heads):
    assert _heads(roles).retrieval_heads == heads


@pytest.mark.parametrize("identity, ok", [
    (ModelIdentity(2, 4, 2, 8), True), (ModelIdentity(2, 4, 4, 8), True), (ModelIdentity(2, 4, 3, 8), False),
    (ModelIdentity(2, 4, 1, 8, sliding_layers=[0, 1]), True),
    (ModelIdentity(2, 4, 1, 8, sliding_layers=[2]), False), (ModelIdentity(2, 4, 1, 8, sliding_layers=[-1]), False),
    (ModelIdentity(1, 1, 1, 1), True), (ModelIdentity(0, 1, 1, 1), False),
])
def test_a_manifests_model_identity_at_its_ends(identity, ok):
    """Query heads a multiple of the KV heads (equal counts too), sliding layers in [0, L − 1], counts ≥ 1."""
    if ok:
        RoleManifest(identity)
    else:
        with pytest.raises(ManifestError):
            RoleManifest(identity)


# -- paths as file names -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, portable", [
    (None, None), ("", ""), ("pg-essays", "pg-essays"), ("org/name", "org/name"), ("booksum[:100]", "booksum[:100]"),
    ("/data/x/essays.txt", "essays.txt"), ("text:/data/x/a.txt", "text:a.txt"), ("d/f.jsonl", "f.jsonl"),
    ("jsonl:d/f.jsonl", "jsonl:f.jsonl"), ("d", "d"),
])
def test_portable_name_keeps_only_local_paths_file_names(tmp_path, monkeypatch, value, portable):
    """An absolute path, or a relative one that exists (here ``d/f.jsonl``), becomes its file name, also after
    ``kind:``; aliases and hub ids stay."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.jsonl").write_text("{}\n")
    assert portable_name(value) == portable


# -- config layers and registries --------------------------------------------------------------------------------------
@dataclass
class _Settings:
    a: int = 1
    b: str = "x"


@pytest.mark.parametrize("layers, a, b", [
    ((), 1, "x"), (({"a": 2},), 2, "x"), (({"a": 2}, {"a": 3}), 3, "x"), (({"a": 2}, {"a": None}), 2, "x"),
    (({"a": 2}, None, {"b": "y"}), 2, "y"), (({"a": None},), 1, "x"),
])
def test_later_layers_win_and_none_is_unset(layers, a, b):
    got = layered(_Settings, *layers, what="s")
    assert (got.a, got.b) == (a, b)


@pytest.mark.parametrize("layer, says", [
    ({"c": 1}, "s: unknown option 'c'; known options: a, b"),
    ({"d": 1, "c": 2}, "s: unknown options 'c', 'd'; known options: a, b"),
])
def test_unknown_options_are_named_in_one_line(layer, says):
    with pytest.raises(ConfigError) as info:
        layered(_Settings, {"a": 2}, layer, what="s")
    assert str(info.value) == says


@pytest.mark.parametrize("ordered, listed", [(False, "alpha, beta, gamma"), (True, "gamma, alpha, beta")])
def test_a_registry_lists_its_names_sorted_or_in_order(ordered, listed):
    reg = Registry("thing", ordered=ordered)
    for name in ("gamma", "alpha", "beta"):
        reg.register(name)((name,))  # any object but a string is the entry itself
    assert reg.lookup("beta") == ("beta",)
    reg["path"] = "os.path:join"  # a "module:attr" entry is imported on lookup
    assert reg.lookup("path") is __import__("os").path.join
    with pytest.raises(ValueError, match=f"^unknown thing 'delta'; choose one of {listed}, path$"):
        reg.lookup("delta")


@pytest.mark.parametrize("name_length", range(16))
def test_manifest_header_is_padded_to_a_multiple_of_8_bytes(name_length):
    """The header holds the canonical JSON and then fewer than 8 spaces, so the tensor data starts 8-byte aligned
    (as safetensors writes it), whatever length the JSON has: model names of 0..15 characters reach every
    remainder mod 8."""
    import json
    import struct

    from rolecall.core.manifest import ModelIdentity, RoleManifest

    identity = ModelIdentity(2, 2, 1, 8, name="m" * name_length or None)
    blob = RoleManifest(identity, layer_role=torch.tensor([0, 1], dtype=torch.int8)).to_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = blob[8:8 + length]
    text = header.rstrip(b" ")
    assert length % 8 == 0 and len(header) - len(text) < 8 and json.loads(text)["layers.role"]["shape"] == [2]
    offsets = json.loads(text)["layers.role"]["data_offsets"]
    assert blob[8 + length + offsets[0]:8 + length + offsets[1]] == bytes([0, 1])
    assert len(blob) == 8 + length + max(v["data_offsets"][1] for k, v in json.loads(text).items() if k != "__metadata__")
