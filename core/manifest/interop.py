"""Convert role manifests to and from other tools' formats, and merge a layers manifest with a heads manifest.

Formats:

``duo``
    DuoAttention's attention pattern: a folder with ``full_attention_heads.tsv`` (one row per layer, one
    tab-separated gate value in [0, 1] per KV head) and ``config.json`` (``sink_size``, ``recent_size``).
    Export writes the learned E[z] when the heads' roles equal ``E[z] > 0.5``, otherwise the roles as 0/1, so
    that importing with the default threshold gives back the same roles.
``json``
    Everything in the manifest as one JSON document, for runtimes that do not read safetensors. Lossless.
``layers``
    A TidalDecode/DELTA-style layer list: which layers run full attention and which select tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolecall.core.atomic import write_text
from rolecall.core.configfile import read_mapping
from rolecall.core.manifest import (
    LAYER_ROLE_FULL,
    LAYER_ROLE_SELECT,
    LAYER_ROLE_SPARSE,
    ManifestError,
    ManifestMismatchError,
    ModelIdentity,
    RoleManifest,
)

FORMATS = ("duo", "json", "layers")  # and "hub" (rolecall.core.manifest.hub), written from the file by rolecall export
DUO_TSV = "full_attention_heads.tsv"
# what import reads in each format
SOURCES = {"duo": f"a DuoAttention pattern folder or its {DUO_TSV}",
           "json": "the JSON that rolecall export --format json writes",
           "layers": 'a layer list as rolecall export --format layers writes it ({"full_attention_layers": [...], ...})'}
JSON_FORMAT = "rolecall.manifest.json"
LAYERS_FORMAT = "rolecall.layers"


# -- export ---------------------------------------------------------------------------------------------------
def to_duo_gates(manifest: RoleManifest) -> np.ndarray:
    """``[L, Hkv]`` float gate values whose 0.5 threshold reproduces ``heads.role``."""
    if manifest.head_role is None:
        raise ManifestError("this manifest has no heads section; DuoAttention patterns are per head (use train-heads)")
    roles = manifest.head_role.numpy().astype(np.float64)
    gates = manifest.head_expected_gate
    if gates is not None and np.array_equal(gates.numpy() > 0.5, roles > 0.5):
        return gates.numpy().astype(np.float64)
    return roles


def export_manifest(manifest: RoleManifest, fmt: str, out: str | os.PathLike, sink_size: int = 64,
                    recent_size: int = 256) -> Path:
    """Write ``manifest`` as ``fmt`` to ``out`` (a folder for ``duo``, a file otherwise)."""
    out = Path(out)
    if fmt == "duo":
        gates = to_duo_gates(manifest)
        rows = ["\t".join(repr(float(v)) for v in row) for row in gates]
        write_text(out / DUO_TSV, "\n".join(rows) + "\n")
        write_text(out / "config.json", json.dumps({"sink_size": sink_size, "recent_size": recent_size}, indent=2) + "\n")
        return out
    if fmt == "json":
        write_text(out, json.dumps(to_json(manifest), indent=1, sort_keys=True) + "\n")
        return out
    if fmt == "layers":
        write_text(out, json.dumps(to_layer_list(manifest), indent=2, sort_keys=True) + "\n")
        return out
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def to_json(manifest: RoleManifest) -> dict[str, Any]:
    doc: dict[str, Any] = {"format": JSON_FORMAT, "schema_version": 1, "model": vars(manifest.model).copy()}
    for name, t in manifest.tensors().items():
        section, key = name.split(".", 1)
        doc.setdefault(section, {})[key] = t.tolist()
    if manifest.layer_role is not None:
        doc["layers"]["delta_layers"] = manifest.delta_layers
    for key in ("config", "data", "metrics"):
        if getattr(manifest, key):
            doc[key] = getattr(manifest, key)
    return doc


def to_layer_list(manifest: RoleManifest) -> dict[str, Any]:
    if manifest.layer_role is None:
        raise ManifestError("this manifest has no layers section; a layer list needs calibrate-delta's layer roles")
    roles = manifest.layer_role.tolist()
    return {
        "format": LAYERS_FORMAT,
        "num_layers": len(roles),
        "full_attention_layers": [i for i, r in enumerate(roles) if r in (LAYER_ROLE_FULL, LAYER_ROLE_SELECT)],
        "token_selection_layers": [i for i, r in enumerate(roles) if r == LAYER_ROLE_SELECT],
        "model": manifest.model.name,
    }


# -- import ---------------------------------------------------------------------------------------------------
def check_source(path: str | os.PathLike, fmt: str) -> None:
    """Refuse, in one line naming what ``fmt`` reads, a ``path`` that is missing, or a folder where the format
    reads a file (only ``duo`` takes a folder): what ``rolecall import`` checks before it looks up the model."""
    source = Path(path)
    if not (source.is_file() or (fmt == "duo" and source.is_dir())):
        missing = "no such file or folder" if fmt == "duo" else "no such file"
        raise ValueError(f"{path}: {'a folder' if source.is_dir() else missing}; --format {fmt} reads {SOURCES[fmt]}")


def read_duo_gates(path: str | os.PathLike) -> np.ndarray:
    """``[L, Hkv]`` gate values from a DuoAttention pattern folder or its TSV file."""
    path = Path(path)
    tsv = path / DUO_TSV if path.is_dir() else path
    if not tsv.is_file():
        raise OSError(f"{tsv}: no such file; pass {SOURCES['duo']}")
    rows = [line.split("\t") for line in tsv.read_text().splitlines() if line.strip()]
    try:
        values = [[float(v) for v in row] for row in rows]
    except ValueError:
        raise ManifestError(f"{tsv}: expected rows of tab-separated numbers (layers × KV heads)") from None
    if not values or len({len(row) for row in values}) != 1:
        raise ManifestError(f"{tsv}: empty, or rows have different lengths; expected layers × KV heads")
    return np.clip(np.array(values, dtype=np.float64), 0.0, 1.0)


def duo_roles(gates: np.ndarray, threshold: float = 0.5, sparsity: float | None = None,
              num_retrieval: int | None = None) -> np.ndarray:
    """Binary retrieval roles from gate values: the top ``num_retrieval``, the ``1 - sparsity`` fraction with the
    largest gates (DuoAttention's quantile rule), or ``gate > threshold``. Ties break towards earlier heads."""
    flat = gates.reshape(-1)
    if num_retrieval is None and sparsity is not None:
        if not 0.0 <= sparsity <= 1.0:
            raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
        num_retrieval = int(round((1.0 - sparsity) * flat.size))
    if num_retrieval is not None:
        if not 0 <= num_retrieval <= flat.size:
            raise ValueError(f"num_retrieval must be in [0, {flat.size}], got {num_retrieval}")
        order = np.argsort(-flat, kind="stable")[:num_retrieval]
        roles = np.zeros(flat.size, dtype=np.int8)
        roles[order] = 1
        return roles.reshape(gates.shape)
    return (gates > threshold).astype(np.int8)


def import_manifest(path: str | os.PathLike, fmt: str, config: Any, name: str | None = None, **rule: Any) -> RoleManifest:
    """Build a manifest for the model of ``config`` from a file in ``fmt``; checks it fits that model."""
    identity = ModelIdentity.from_config(config, name=name)
    if fmt == "duo":
        gates = read_duo_gates(path)
        want = (identity.num_layers, identity.num_kv_heads)
        if gates.shape != want:
            raise ManifestMismatchError(
                f"{path}: pattern is {gates.shape[0]} layers × {gates.shape[1]} KV heads but the model has "
                f"{want[0]} × {want[1]}; use a pattern made for this model"
            )
        roles = duo_roles(gates, **rule)
        roles[0, :] = 1  # layer 0 selects for the layers after it, so it always attends fully
        return RoleManifest(identity, head_role=torch.from_numpy(roles), head_expected_gate=torch.from_numpy(gates),
                            data={"source": f"duo:{Path(path).name}"}, config={"import": {"format": "duo", **rule}})
    if fmt == "json":
        return _from_json(_read_json(path, "JSON manifest", f"give {SOURCES['json']}"), config)
    if fmt == "layers":
        doc = _read_json(path, "layer list", f"give {SOURCES['layers']}")
        L = identity.num_layers
        if doc.get("num_layers", L) != L:
            raise ManifestMismatchError(f"{path}: num_layers is {doc['num_layers']} in the list but {L} in the model")
        roles = torch.full((L,), LAYER_ROLE_SPARSE, dtype=torch.int8)
        select = set(doc.get("token_selection_layers", []))
        for i in doc.get("full_attention_layers", []):
            roles[i] = LAYER_ROLE_SELECT if i in select else LAYER_ROLE_FULL
        for i in select:
            roles[i] = LAYER_ROLE_SELECT
        return RoleManifest(identity, layer_role=roles, data={"source": f"layers:{Path(path).name}"})
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def _read_json(path: str | os.PathLike, what: str, fix: str) -> dict[str, Any]:
    """A JSON object from ``path``, or one line naming the file, what is wrong and what the format wants."""
    return read_mapping(Path(path), what, fix, ManifestError, json_only=True, shape="a JSON object")


def _from_json(doc: dict[str, Any], config: Any) -> RoleManifest:
    if doc.get("format") != JSON_FORMAT:
        raise ManifestError(f"not a rolecall JSON manifest (format is {doc.get('format')!r}, expected {JSON_FORMAT!r})")
    model = ModelIdentity(**doc["model"])
    manifest = RoleManifest(model, **{
        attr: torch.tensor(doc[section][key], dtype=dtype)
        for section, key, attr, dtype in _JSON_TENSORS if key in doc.get(section, {})
    }, config=doc.get("config", {}), data=doc.get("data", {}), metrics=doc.get("metrics", {}))
    manifest.validate_for(config)
    return manifest


_JSON_TENSORS = [
    ("layers", "role", "layer_role", torch.int8), ("layers", "shift", "layer_shift", torch.float32),
    ("layers", "sparsity", "layer_sparsity", torch.float32), ("layers", "budget", "layer_budget", torch.float32),
    ("heads", "role", "head_role", torch.int8), ("heads", "alpha", "head_alpha", torch.float32),
    ("heads", "beta", "head_beta", torch.float32), ("heads", "expected_gate", "head_expected_gate", torch.float32),
]


# -- merge ----------------------------------------------------------------------------------------------------
def merge_manifests(a: RoleManifest, b: RoleManifest) -> RoleManifest:
    """One manifest with the layers section of one input and the heads section of the other."""
    for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "config_sha256"):
        va, vb = getattr(a.model, key), getattr(b.model, key)
        if va is not None and vb is not None and va != vb:
            raise ManifestMismatchError(f"cannot merge manifests of different models: model.{key} is {va} and {vb}")
    overlap = set(a.sections) & set(b.sections)
    if overlap:
        raise ManifestError(f"both manifests have a {'/'.join(sorted(overlap))} section; merge a layers manifest "
                            "(calibrate-delta) with a heads manifest (train-heads)")
    layers, heads = (a, b) if "layers" in a.sections else (b, a)
    model = layers.model if layers.model.config_sha256 else heads.model
    return RoleManifest(
        model,
        layer_role=layers.layer_role, layer_shift=layers.layer_shift, layer_sparsity=layers.layer_sparsity,
        layer_budget=layers.layer_budget, head_role=heads.head_role, head_alpha=heads.head_alpha,
        head_beta=heads.head_beta, head_expected_gate=heads.head_expected_gate,
        config={"layers": layers.config, "heads": heads.config},
        data={"layers": layers.data, "heads": heads.data},
        metrics={"layers": layers.metrics, "heads": heads.metrics},
    )


__all__ = ["FORMATS", "export_manifest", "import_manifest", "merge_manifests", "read_duo_gates", "duo_roles",
           "to_json", "to_layer_list"]
