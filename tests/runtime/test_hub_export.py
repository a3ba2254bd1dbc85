"""rolecall export --format hub: a folder for huggingface-cli upload, checked against its base model, read back by
folder or by a Hub repo id in the local cache."""

from pathlib import Path

import pytest

from rolecall.cli import main as rolecall_main
from rolecall.core.manifest import ManifestError, RoleManifest
from tests.tiny import tiny_folder

ART = Path(__file__).resolve().parents[2] / "artifacts" / "smollm2-135m"
DELTA, HEADS = ART / "smollm2-135m.delta.safetensors", ART / "heads-hardkuma.safetensors"


def export(manifest: Path, out: Path, *extra: str) -> int:
    return rolecall_main(["export", str(manifest), "--format", "hub", "-o", str(out), *extra])


def test_a_layers_manifest_becomes_a_hub_folder_that_loads_back(tmp_path, capsys):
    out = tmp_path / "hub"
    assert export(DELTA, out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "layers.json", "manifest.safetensors"]
    assert (out / "manifest.safetensors").read_bytes() == DELTA.read_bytes()  # unchanged: its hash verifies
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\nlibrary_name: rolecall\ntags:\n")
    assert "- delta\n---\n" in card and "Δ-layers [2, 12, 16]" in card and str(tmp_path) not in card
    loaded = RoleManifest.load(out)  # --manifest takes the folder
    assert loaded.to_bytes() == RoleManifest.load(DELTA).to_bytes()
    assert rolecall_main(["inspect", str(out), "--verify"]) == 0
    again = tmp_path / "again"
    assert export(DELTA, again) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in again.iterdir()}


def test_a_heads_manifest_brings_its_duoattention_pattern(tmp_path):
    out = tmp_path / "hub"
    assert export(HEADS, out) == 0
    assert (out / "duo" / "full_attention_heads.tsv").is_file() and not (out / "layers.json").exists()
    card = (out / "README.md").read_text()
    assert "- lycheedecode\n" in card and "8 retrieval KV heads past layer 0" in card


def test_a_base_model_of_another_shape_is_refused_before_anything_is_written(tmp_path, capsys):
    other = tiny_folder(tmp_path / "tiny", "llama")
    capsys.readouterr()
    out = tmp_path / "hub"
    assert export(DELTA, out, "--base-model", str(other)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rolecall export: error: --base-model {other}: "), err
    assert not out.exists()


def test_a_hub_repo_id_is_read_from_the_local_cache_or_named(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ManifestError, match=r"^someone/roles: no such file here, and no Hub repo of that id in the "
                                            r"local Hugging Face cache; download it"):
        RoleManifest.load("someone/roles")
    repo = tmp_path / "cache" / "models--someone--roles"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "manifest.safetensors").write_bytes(DELTA.read_bytes())
    assert RoleManifest.load("someone/roles").delta_layers == [2, 12, 16]
