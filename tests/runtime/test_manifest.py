import json
import pickle
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rolecall.core.manifest import (
    SCHEMA_VERSION,
    ManifestError,
    ManifestMismatchError,
    ModelIdentity,
    RoleManifest,
    config_sha256,
)
from tests.tiny import tiny_config


def make(model_config=None, **kw):
    config = model_config or tiny_config("llama", layers=4, heads=4, kv_heads=2)
    L, H = config.num_hidden_layers, config.num_key_value_heads
    g = torch.Generator().manual_seed(1)
    fields = dict(
        layer_role=torch.tensor([0, 0, 1, 2][:L], dtype=torch.int8),
        layer_shift=torch.rand(L, generator=g),
        layer_sparsity=torch.rand(L, 5, generator=g),
        layer_budget=torch.rand(L, generator=g),
        head_role=(torch.rand(L, H, generator=g) > 0.5).to(torch.int8),
        head_alpha=torch.rand(L, H, generator=g) + 0.5,
        head_beta=torch.rand(L, H, generator=g) + 0.5,
        head_expected_gate=torch.rand(L, H, generator=g),
        config={"num_delta": 1, "page_size": 16},
        data={"source": "arithmetic", "sha256": "ab" * 32},
        metrics={"recall": 0.9},
    )
    fields.update(kw)
    return RoleManifest(ModelIdentity.from_config(config, name="tiny-llama"), **fields)


def test_round_trip_is_bit_identical(tmp_path):
    m = make()
    p1, p2 = m.save(tmp_path / "a.safetensors"), tmp_path / "b.safetensors"
    loaded = RoleManifest.load(p1)
    loaded.save(p2)
    assert p1.read_bytes() == p2.read_bytes()
    for name, t in m.tensors().items():
        assert torch.equal(loaded.tensors()[name], t), name
    assert loaded.config == m.config and loaded.data == m.data and loaded.metrics == m.metrics
    assert loaded.model == m.model


def test_bytes_do_not_depend_on_dict_order():
    a = make(config={"a": 1, "b": {"x": 1, "y": 2}})
    b = make(config={"b": {"y": 2, "x": 1}, "a": 1})
    assert a.to_bytes() == b.to_bytes()


def test_safetensors_reads_our_file(tmp_path):
    m = make()
    path = m.save(tmp_path / "m.safetensors")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert meta["format"] == "rolecall.manifest"
        assert meta["schema_version"] == str(SCHEMA_VERSION)
        assert meta["sections"] == "layers,heads"
        assert meta["model.num_layers"] == "4"
        assert json.loads(meta["config"]) == {"num_delta": 1, "page_size": 16}
        assert set(f.keys()) == set(m.tensors())
        for name, t in m.tensors().items():
            assert torch.equal(f.get_tensor(name), t)


def _schema_meta(config):
    ident = ModelIdentity.from_config(config)
    return {
        "format": "rolecall.manifest", "schema_version": "1", "sections": "heads",
        "model.num_layers": str(ident.num_layers), "model.num_heads": str(ident.num_heads),
        "model.num_kv_heads": str(ident.num_kv_heads), "model.head_dim": str(ident.head_dim),
        "writer.tool": "someone-else",
    }


def test_file_from_another_writer_loads_and_keeps_unknown_keys(tmp_path):
    """Without a content hash it loads only with strict=False, which says it was not verified."""
    from rolecall.core.manifest import UnverifiedManifestError, UnverifiedManifestWarning

    config = tiny_config("qwen2", layers=3, heads=4, kv_heads=1)
    role = torch.tensor([[1], [0], [1]], dtype=torch.int8)
    save_file({"heads.role": role}, str(tmp_path / "x.safetensors"), metadata=_schema_meta(config))
    with pytest.raises(UnverifiedManifestError, match="no content hash"):
        RoleManifest.load(tmp_path / "x.safetensors")
    with pytest.warns(UnverifiedManifestWarning, match="loaded without verification"):
        m = RoleManifest.load(tmp_path / "x.safetensors", strict=False)
    assert m.sections == ["heads"] and m.retrieval_heads == [(0, 0), (2, 0)]
    assert m.extra == {"writer.tool": "someone-else"}
    m.validate_for(config)  # no config hash in the file: counts are enough
    assert "writer.tool" in m.metadata()


def test_validate_for_names_the_field_and_both_values():
    m = make()
    with pytest.raises(ManifestMismatchError, match=r"num_layers is 4 in the manifest .* but 6 in the model"):
        m.validate_for(tiny_config("llama", layers=6, heads=4, kv_heads=2))
    with pytest.raises(ManifestMismatchError, match=r"num_kv_heads is 2 .* but 1"):
        m.validate_for(tiny_config("llama", layers=4, heads=4, kv_heads=1))
    with pytest.raises(ManifestMismatchError, match=r"head_dim is 16 .* but 32"):
        m.validate_for(tiny_config("llama", layers=4, heads=4, kv_heads=2, head_dim=32))
    other = tiny_config("llama", layers=4, heads=4, kv_heads=2, intermediate_size=96)
    with pytest.raises(ManifestMismatchError, match="config_sha256"):
        m.validate_for(other)
    m.validate_for(other, strict=False)
    m.validate_for(tiny_config("llama", layers=4, heads=4, kv_heads=2))


def test_head_dim_of_a_config_without_one_is_the_hidden_size_over_the_query_heads():
    from types import SimpleNamespace

    # 64 hidden over 4 query heads: 16 per head, whatever the 2 KV heads are
    config = SimpleNamespace(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert ModelIdentity.from_config(config).head_dim == 16


def test_config_hash_ignores_runtime_settings():
    a = tiny_config("llama")
    b = tiny_config("llama", rope_theta=400000.0)
    b._attn_implementation = "eager"
    assert config_sha256(a) == config_sha256(b)
    assert config_sha256(a) != config_sha256(tiny_config("llama", vocab_size=300))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[: len(b) - 7], "truncated"),
        (lambda b: b[:20], "truncated"),
        (lambda b: b[:5], "too short"),
        (lambda b: struct.pack("<Q", 10) + b"not json!!", "header is not JSON"),
        (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "header of 1,099,511,627,776 bytes, more than the 67,108,864"),
        (lambda b: b'{"layers": {"role": [2, 0]}}', r"JSON; make one from it with `rolecall import .* --format json"),
    ],
)
def test_broken_files_are_refused_by_name(tmp_path, mutate, message):
    path = tmp_path / "m.safetensors"
    path.write_bytes(mutate(make().to_bytes()))
    with pytest.raises(ManifestError, match=message):
        RoleManifest.load(path)


def test_refusals(tmp_path):
    config = tiny_config("llama", layers=2, heads=4, kv_heads=1)
    meta = _schema_meta(config)
    cases = {
        "other.safetensors": ({"x": torch.zeros(2)}, {"format": "pt"}, "not a rolecall manifest"),
        "newer.safetensors": ({}, {**meta, "schema_version": "2", "sections": ""}, "newer than this rolecall reads"),
        "dtype.safetensors": ({"heads.role": torch.zeros(2, 1)}, meta, "has dtype F32, schema 1 requires I8"),
        "shape.safetensors": ({"heads.role": torch.zeros(3, 1, dtype=torch.int8)}, meta, r"shape \(3, 1\), expected \(2, 1\)"),
        "values.safetensors": ({"heads.role": torch.full((2, 1), 5, dtype=torch.int8)}, meta, "outside"),
        "unknown.safetensors": ({"heads.mystery": torch.zeros(2, 1)}, meta, "unknown tensor 'heads.mystery'"),
        "missing.safetensors": ({"heads.role": torch.zeros(2, 1, dtype=torch.int8)},
                                {k: v for k, v in meta.items() if k != "model.head_dim"}, "'model.head_dim' is missing"),
        "sections.safetensors": ({"heads.role": torch.zeros(2, 1, dtype=torch.int8)}, {**meta, "sections": "layers"},
                                 "sections"),
    }
    for name, (tensors, metadata, message) in cases.items():
        save_file(tensors, str(tmp_path / name), metadata=metadata)
        with pytest.raises(ManifestError, match=message):
            RoleManifest.load(tmp_path / name)
    with pytest.raises(ManifestError, match="no such manifest"):
        RoleManifest.load(tmp_path / "absent.safetensors")
    with pytest.raises(ManifestError, match=f"^{tmp_path}: a folder, not a manifest file; give the path of a "
                       r"manifest file \(\.safetensors\)$"):
        RoleManifest.load(tmp_path)


class _Boom:
    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.target),))


def test_a_pickle_is_never_unpickled(tmp_path):
    boom = _Boom()
    boom.target = str(tmp_path / "pwned")
    path = tmp_path / "evil.safetensors"
    path.write_bytes(pickle.dumps(boom))
    with pytest.raises(ManifestError, match="not a rolecall manifest|truncated|too short"):
        RoleManifest.load(path)
    assert not (tmp_path / "pwned").exists()


def test_save_is_atomic(tmp_path, monkeypatch):
    path = make().save(tmp_path / "m.safetensors")
    before = path.read_bytes()

    def fail(self):
        raise RuntimeError("disk full")

    monkeypatch.setattr(RoleManifest, "to_bytes", fail)
    with pytest.raises(RuntimeError):
        make(metrics={"recall": 0.1}).save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_constructor_checks_itself():
    config = tiny_config("llama", layers=4, heads=4, kv_heads=2)
    ident = ModelIdentity.from_config(config)
    with pytest.raises(ManifestError, match=r"layers.role has shape \(3,\)"):
        RoleManifest(ident, layer_role=torch.zeros(3, dtype=torch.int8))
    with pytest.raises(ManifestError, match="layers.role must be torch.int8"):
        RoleManifest(ident, layer_role=torch.zeros(4))
    m = RoleManifest(ident, layer_role=[0, 0, 1, 2])
    assert m.layer_role.dtype == torch.int8 and m.delta_layers == [2]
    assert RoleManifest(ident).sections == []


def test_flipped_bytes_are_reported(tmp_path):
    good = make().to_bytes()
    header_len = struct.unpack("<Q", good[:8])[0]
    # one byte inside the tensor data, and one metadata value that still parses as JSON
    data_flip = bytearray(good)
    data_flip[8 + header_len + 3] ^= 0x01
    meta_flip = good.replace(b'"model.name":"tiny-llama"', b'"model.name":"tiny-llamb"')
    assert meta_flip != good
    for i, buf in enumerate([bytes(data_flip), meta_flip]):
        path = tmp_path / f"bad{i}.safetensors"
        path.write_bytes(buf)
        with pytest.raises(ManifestError, match="corrupted: content hash"):
            RoleManifest.load(path)
    # every single-bit flip anywhere in the file is refused
    for pos in range(len(good)):
        for bit in (0x01, 0x20, 0x80):
            buf = bytearray(good)
            buf[pos] ^= bit
            with pytest.raises(ManifestError):
                RoleManifest.from_bytes(bytes(buf))
