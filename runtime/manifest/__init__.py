"""The role manifest: one safetensors file that says which layers and heads of a model need full attention.

Schema 1 (see ``artifacts/README.md`` for the full description):

=========================  ==================  ======================================================
tensor                     dtype, shape        meaning
=========================  ==================  ======================================================
``layers.role``            int8 ``[L]``        0 full (warm-up), 1 selection (Δ), 2 sparse
``layers.shift``           float32 ``[L]``     mean ``1 - cos(a[l-1], a[l])``; 0 for layer 0
``layers.sparsity``        float32 ``[L, B]``  mean Hoyer sparsity per layer over B decode-time bins
``layers.budget``          float32 ``[L]``     fraction of the context each layer keeps (Lethe)
``heads.role``             int8 ``[L, Hkv]``   1 retrieval, 0 sparse (layer 0 all retrieval)
``heads.alpha``/``.beta``  float32 ``[L, Hkv]`` learned HardKuma parameters
``heads.expected_gate``    float32 ``[L, Hkv]`` E[z] at the end of training
=========================  ==================  ======================================================

The file is written by hand rather than through ``safetensors.torch.save_file`` so that it is byte-for-byte
deterministic (sorted JSON keys, tensors laid out in name order) and atomic (temporary file, then rename).
Reading parses the header as JSON and the tensors as raw little-endian bytes: nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "rolecall.manifest"
SCHEMA_VERSION = 1

LAYER_ROLE_FULL, LAYER_ROLE_SELECT, LAYER_ROLE_SPARSE = 0, 1, 2
HEAD_ROLE_SPARSE, HEAD_ROLE_RETRIEVAL = 0, 1

# tensor name -> (dataclass field, dtype, shape kind, section)
_TENSORS: dict[str, tuple[str, torch.dtype, str, str]] = {
    "layers.role": ("layer_role", torch.int8, "L", "layers"),
    "layers.shift": ("layer_shift", torch.float32, "L", "layers"),
    "layers.sparsity": ("layer_sparsity", torch.float32, "LB", "layers"),
    "layers.budget": ("layer_budget", torch.float32, "L", "layers"),
    "heads.role": ("head_role", torch.int8, "LH", "heads"),
    "heads.alpha": ("head_alpha", torch.float32, "LH", "heads"),
    "heads.beta": ("head_beta", torch.float32, "LH", "heads"),
    "heads.expected_gate": ("head_expected_gate", torch.float32, "LH", "heads"),
}
_ST_DTYPES = {torch.int8: "I8", torch.float32: "F32"}
_ST_DTYPES_BACK = {v: k for k, v in _ST_DTYPES.items()}
_NP_DTYPES = {torch.int8: np.dtype("i1"), torch.float32: np.dtype("<f4")}
_JSON_KEYS = ("config", "data", "metrics")  # metadata values that hold JSON documents
_MAX_HEADER = 64 * 1024 * 1024
_MADE_BY = "give a manifest that calibrate-delta, train-heads, rolecall merge or rolecall import wrote"
CONTENT_HASH_KEY = "content_sha256"  # metadata key; checked on load when present


class ManifestError(ValueError):
    """A file is not a valid rolecall manifest (the message says what is wrong and how to fix it)."""


class ManifestMismatchError(ManifestError):
    """A manifest was made for another model; the message names the field and both values."""


def _arch(config: Any) -> dict[str, Any]:
    """The architecture fields of a transformers config (or of a model, through ``.config``)."""
    config = getattr(config, "config", config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return {
        "model_type": getattr(text, "model_type", ""),
        "num_hidden_layers": int(text.num_hidden_layers),
        "hidden_size": int(text.hidden_size),
        "intermediate_size": int(getattr(text, "intermediate_size", 0) or 0),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": int(head_dim),
        "vocab_size": int(getattr(text, "vocab_size", 0) or 0),
        "layer_types": list(getattr(text, "layer_types", None) or []),
        "sliding_window": getattr(text, "sliding_window", None),
    }


def config_sha256(config: Any) -> str:
    """Hash of a config's architecture (shapes, layer types), not of its run-time settings.

    Loading options (dtype, attention implementation, quantisation, RoPE scaling) do not change the hash, so a
    manifest made on a GGUF-loaded model fits the same model saved as safetensors.
    """
    text = json.dumps(_arch(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class ModelIdentity:
    """What a manifest was made for."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    name: str | None = None
    revision: str | None = None
    config_sha256: str | None = None
    # layers with their own sliding-window attention (hybrid models); None: not recorded (no such layer, or an
    # older manifest). Metadata key model.sliding_layers, comma-separated, written only when non-empty.
    sliding_layers: list[int] | None = None

    @classmethod
    def from_config(cls, config: Any, name: str | None = None, revision: str | None = None) -> ModelIdentity:
        from runtime.models import sliding_layers

        a = _arch(config)
        cfg = getattr(config, "config", config)
        name = name or getattr(cfg, "_name_or_path", None) or None
        return cls(a["num_hidden_layers"], a["num_attention_heads"], a["num_key_value_heads"], a["head_dim"],
                   name=name, revision=revision, config_sha256=config_sha256(config),
                   sliding_layers=sliding_layers(config) or None)


@dataclass
class RoleManifest:
    """Layer and head roles of one model. Every tensor section is optional.

    Tensors live on the CPU; shapes use L = layers, Hkv = KV heads, B = decode-time bins.
    """

    model: ModelIdentity
    layer_role: torch.Tensor | None = None  # int8 [L]
    layer_shift: torch.Tensor | None = None  # float32 [L]
    layer_sparsity: torch.Tensor | None = None  # float32 [L, B]
    layer_budget: torch.Tensor | None = None  # float32 [L]
    head_role: torch.Tensor | None = None  # int8 [L, Hkv]
    head_alpha: torch.Tensor | None = None  # float32 [L, Hkv]
    head_beta: torch.Tensor | None = None  # float32 [L, Hkv]
    head_expected_gate: torch.Tensor | None = None  # float32 [L, Hkv]
    config: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    # wall-clock time of older files' runs, read and written back unchanged; rolecall no longer sets it, so that
    # two identical runs write identical bytes
    created: str | None = None
    rolecall_version: str | None = None
    extra: dict[str, str] = field(default_factory=dict)  # unknown metadata keys, kept as they came

    def __post_init__(self) -> None:
        for name, (attr, dtype, _, _) in _TENSORS.items():
            value = getattr(self, attr)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                value = torch.as_tensor(value)
            if value.is_floating_point() != dtype.is_floating_point:
                raise ManifestError(f"{name} must be {dtype} but is {value.dtype}; convert it before building the manifest")
            setattr(self, attr, value.detach().to("cpu", dtype).contiguous())
        self._check_shapes()
        if self.rolecall_version is None:
            from runtime import __version__

            self.rolecall_version = __version__

    # -- structure ---------------------------------------------------------------------------------------------
    @property
    def sections(self) -> list[str]:
        present = {_TENSORS[n][3] for n in _TENSORS if getattr(self, _TENSORS[n][0]) is not None}
        return [s for s in ("layers", "heads") if s in present]

    @property
    def delta_layers(self) -> list[int]:
        """Indices of the Δ (selection) layers, empty without a ``layers`` section."""
        if self.layer_role is None:
            return []
        return torch.nonzero(self.layer_role == LAYER_ROLE_SELECT).flatten().tolist()

    @property
    def retrieval_heads(self) -> list[tuple[int, int]]:
        """(layer, KV head) pairs with the retrieval role."""
        if self.head_role is None:
            return []
        return [tuple(x) for x in torch.nonzero(self.head_role == HEAD_ROLE_RETRIEVAL).tolist()]

    def _check_shapes(self) -> None:
        m = self.model
        for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(m, key)
            if not isinstance(value, int) or value <= 0:
                raise ManifestError(f"model.{key} must be a positive integer, got {value!r}")
        if m.num_heads % m.num_kv_heads:
            raise ManifestError(f"model.num_heads ({m.num_heads}) is not a multiple of model.num_kv_heads ({m.num_kv_heads})")
        for name, (attr, _, kind, _) in _TENSORS.items():
            t = getattr(self, attr)
            if t is None:
                continue
            want = {"L": (m.num_layers,), "LH": (m.num_layers, m.num_kv_heads)}.get(kind)
            ok = tuple(t.shape) == want if want else (t.dim() == 2 and t.shape[0] == m.num_layers and t.shape[1] >= 1)
            if not ok:
                expect = want if want else f"({m.num_layers}, B>=1)"
                raise ManifestError(f"{name} has shape {tuple(t.shape)}, expected {expect} for this model")
        if self.layer_role is not None and not bool(((self.layer_role >= 0) & (self.layer_role <= 2)).all()):
            raise ManifestError("layers.role holds values outside {0 full, 1 selection, 2 sparse}")
        if self.head_role is not None and not bool(((self.head_role == 0) | (self.head_role == 1)).all()):
            raise ManifestError("heads.role holds values outside {0 sparse, 1 retrieval}")

    # -- validation against a model ----------------------------------------------------------------------------
    def validate_for(self, config: Any, strict: bool = True) -> None:
        """Refuse this manifest if it was made for another model.

        ``config`` is a transformers config or a model. Counts are always checked; the architecture hash only
        when ``strict`` (pass ``strict=False`` to attach a manifest to a model of the same shape whose other
        architecture fields differ, at your own risk).
        """
        a = _arch(config)
        pairs = [
            ("num_layers", self.model.num_layers, a["num_hidden_layers"]),
            ("num_heads", self.model.num_heads, a["num_attention_heads"]),
            ("num_kv_heads", self.model.num_kv_heads, a["num_key_value_heads"]),
            ("head_dim", self.model.head_dim, a["head_dim"]),
        ]
        for key, mine, theirs in pairs:
            if mine != theirs:
                raise ManifestMismatchError(
                    f"manifest does not fit this model: model.{key} is {mine} in the manifest ({self.model.name or 'unnamed'}) "
                    f"but {theirs} in the model; use a manifest made for this model"
                )
        if self.model.sliding_layers is not None:
            from runtime.models import sliding_layers

            if self.model.sliding_layers != sliding_layers(config):
                raise ManifestMismatchError(
                    f"manifest does not fit this model: model.sliding_layers is {self.model.sliding_layers} in the "
                    f"manifest but {sliding_layers(config)} in the model; use a manifest made for this model"
                )
        if strict and self.model.config_sha256 and self.model.config_sha256 != config_sha256(config):
            raise ManifestMismatchError(
                f"manifest does not fit this model: model.config_sha256 is {self.model.config_sha256[:12]}… in the "
                f"manifest but {config_sha256(config)[:12]}… in the model (same counts, other architecture); "
                "pass strict=False to attach it anyway"
            )

    # -- metadata ----------------------------------------------------------------------------------------------
    def metadata(self) -> dict[str, str]:
        meta = dict(self.extra)
        meta.update({
            "format": FORMAT,
            "schema_version": str(SCHEMA_VERSION),
            "sections": ",".join(self.sections),
            "model.num_layers": str(self.model.num_layers),
            "model.num_heads": str(self.model.num_heads),
            "model.num_kv_heads": str(self.model.num_kv_heads),
            "model.head_dim": str(self.model.head_dim),
        })
        for key in ("name", "revision", "config_sha256"):
            value = getattr(self.model, key)
            if value is not None:
                meta[f"model.{key}"] = str(value)
        if self.model.sliding_layers:
            meta["model.sliding_layers"] = ",".join(str(i) for i in self.model.sliding_layers)
        for key in _JSON_KEYS:
            value = getattr(self, key)
            if value:
                meta[key] = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
        for key in ("created", "rolecall_version"):  # created: only an older file's, kept for a byte-exact round trip
            if getattr(self, key):
                meta[key] = getattr(self, key)
        return meta

    # -- I/O ---------------------------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The file's bytes: 8-byte little-endian header length, sorted JSON header, raw tensors in name order."""
        header: dict[str, Any] = {"__metadata__": self.metadata()}
        blobs, offset = [], 0
        for name in sorted(_TENSORS):
            t = getattr(self, _TENSORS[name][0])
            if t is None:
                continue
            raw = np.ascontiguousarray(t.numpy(), dtype=_NP_DTYPES[t.dtype]).tobytes()
            header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
            blobs.append(raw)
            offset += len(raw)
        data = b"".join(blobs)
        header["__metadata__"][CONTENT_HASH_KEY] = content_sha256(header, data)
        text = _canonical(header)
        text += b" " * (-len(text) % 8)  # keep the tensor data 8-byte aligned, as safetensors does
        return struct.pack("<Q", len(text)) + text + data

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically: a temporary file in the same folder, fsync, then rename over ``path``."""
        from runtime.atomic import write_bytes

        return write_bytes(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> RoleManifest:
        return cls.from_bytes(read_manifest_file(path), source=str(path))

    @classmethod
    def from_bytes(cls, buf: bytes, source: str = "<bytes>") -> RoleManifest:
        header, data = _parse(buf, source)
        meta = header.get("__metadata__")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise ManifestError(f"{source}: a safetensors file but not a rolecall manifest (its metadata 'format' is "
                                f"{found!r}, not {FORMAT!r}: model weights, or another tool's file); {_MADE_BY}")
        full_header, header = header, {k: v for k, v in header.items() if k != "__metadata__"}
        version = meta.get("schema_version", "")
        if not str(version).isdigit():
            raise ManifestError(f"{source}: schema_version {version!r} is not an integer")
        if int(version) > SCHEMA_VERSION:
            raise ManifestError(
                f"{source}: manifest schema {version} is newer than this rolecall reads ({SCHEMA_VERSION}); "
                "upgrade rolecall (pip install -U rolecall)"
            )
        model = _identity(meta, source)
        tensors: dict[str, torch.Tensor] = {}
        for name, spec in header.items():
            if name not in _TENSORS:
                raise ManifestError(f"{source}: unknown tensor {name!r} (schema {SCHEMA_VERSION} knows {sorted(_TENSORS)})")
            tensors[_TENSORS[name][0]] = _read_tensor(name, spec, data, source)
        _check_hash(buf, full_header, data, meta, source)
        listed = [s for s in meta.get("sections", "").split(",") if s]
        found = sorted({_TENSORS[n][3] for n in header})
        if sorted(listed) != found:
            raise ManifestError(f"{source}: metadata 'sections' lists {listed} but the file holds {found}")
        known = {f"model.{k}" for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "name", "revision",
                                         "config_sha256", "sliding_layers")} | {"format", "schema_version", "sections", "created",
                                                              CONTENT_HASH_KEY,
                                                              "rolecall_version", *_JSON_KEYS}
        docs = {}
        for key in _JSON_KEYS:
            try:
                docs[key] = json.loads(meta[key]) if key in meta else {}
            except json.JSONDecodeError:
                raise ManifestError(f"{source}: metadata {key!r} is not valid JSON") from None
        return cls(model=model, **tensors, **docs, created=meta.get("created"),
                   rolecall_version=meta.get("rolecall_version", ""),
                   extra={k: v for k, v in meta.items() if k not in known})

    # -- convenience -------------------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """The present tensors by their file names."""
        return {n: getattr(self, a) for n, (a, *_) in _TENSORS.items() if getattr(self, a) is not None}

    def equals(self, other: RoleManifest) -> bool:
        return self.to_bytes() == other.to_bytes()


def read_manifest_file(path: str | os.PathLike) -> bytes:
    """The bytes of the manifest file at ``path``; a missing path or a folder is refused in one line."""
    path = Path(path)
    if path.is_dir():
        raise ManifestError(f"{path}: a folder, not a manifest file; give the path of a manifest file (.safetensors)")
    if not path.is_file():
        raise ManifestError(f"{path}: no such manifest file")
    return path.read_bytes()


def read_metadata(buf: bytes, source: str = "<bytes>") -> dict[str, str]:
    """The metadata of a manifest's bytes, without reading or checking its tensors."""
    header, _ = _parse(buf, source)
    meta = header.get("__metadata__")
    return dict(meta) if isinstance(meta, dict) else {}


def _canonical(header: Mapping[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def portable_name(value: str | None) -> str | None:
    """A path as its file name, so that a manifest does not depend on where its inputs lie.

    Also the path in a ``kind:PATH`` source (``text:/data/a.txt`` → ``text:a.txt``). Values that are not local
    paths (aliases such as ``pg-essays``, Hugging Face ids such as ``org/name``) stay as they are.
    """
    if not value:
        return value
    head, sep, tail = value.rpartition(":")
    path = os.path.expanduser(tail)
    if os.path.isabs(path) or os.path.exists(path):
        return f"{head}{sep}{Path(path).name}"
    return value


def content_sha256(header: Mapping[str, Any], data: bytes | memoryview) -> str:
    """SHA-256 of the canonical header JSON (sorted keys, no spaces, without this hash) and the tensor bytes."""
    meta = {k: v for k, v in header.get("__metadata__", {}).items() if k != CONTENT_HASH_KEY}
    h = hashlib.sha256(_canonical({**header, "__metadata__": meta}))
    h.update(data)
    return h.hexdigest()



def _identity(meta: dict, source: str) -> ModelIdentity:
    """The manifest's model identity from its metadata."""
    try:
        return ModelIdentity(
            *(int(meta[f"model.{k}"]) for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim")),
            name=meta.get("model.name"), revision=meta.get("model.revision"),
            config_sha256=meta.get("model.config_sha256"),
            sliding_layers=[int(i) for i in meta["model.sliding_layers"].split(",") if i.strip()]
            if meta.get("model.sliding_layers") else None,
        )
    except KeyError as e:
        raise ManifestError(f"{source}: required metadata key {e.args[0]!r} is missing") from None
    except ValueError as e:
        raise ManifestError(f"{source}: model counts must be integers ({e})") from None


def _check_hash(buf: bytes, header: dict, data: bytes, meta: dict, source: str) -> None:
    """A file written by rolecall carries the hash of its content; refuse one whose content changed since."""
    if "rolecall_version" in meta and CONTENT_HASH_KEY not in meta:
        raise ManifestError(f"{source}: corrupted: written by rolecall but its {CONTENT_HASH_KEY!r} is missing")
    if CONTENT_HASH_KEY not in meta:
        return
    written, actual = meta[CONTENT_HASH_KEY], content_sha256(header, data)
    # the hash covers the parsed header; a flip that JSON ignores (e.g. into whitespace) shows up here
    raw_header = buf[8 : len(buf) - len(data)].rstrip(b" ")
    if raw_header != _canonical(header):
        actual = "not-canonical"
    if written != actual:
        raise ManifestError(
            f"{source}: corrupted: content hash is {actual[:12]}… but the file says {str(written)[:12]}… "
            "(changed after it was written); restore or re-create the manifest"
        )

def _parse(buf: bytes, source: str) -> tuple[dict[str, Any], memoryview]:
    if len(buf) < 8:
        raise ManifestError(f"{source}: file is {len(buf)} bytes, too short to be a manifest (truncated?)")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > _MAX_HEADER:
        if buf[:1] in (b"{", b"["):  # an export, or another tool's roles
            raise ManifestError(f"{source}: not a rolecall manifest but JSON; make one from it with `rolecall import "
                                f"{source} --format json --model MODEL -o FILE.safetensors` (`--format layers` for a list "
                                "of layers)")
        raise ManifestError(f"{source}: not a rolecall manifest (its first 8 bytes give a header of {n:,} bytes, "
                            f"more than the {_MAX_HEADER:,} a manifest's may take); {_MADE_BY}")
    if 8 + n > len(buf):
        raise ManifestError(f"{source}: truncated: header needs {n} bytes but only {len(buf) - 8} follow")
    try:
        header = json.loads(buf[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ManifestError(f"{source}: not a rolecall manifest (header is not JSON)") from None
    if not isinstance(header, dict):
        raise ManifestError(f"{source}: not a rolecall manifest (header is not a JSON object)")
    return header, memoryview(buf)[8 + n :]


def _read_tensor(name: str, spec: Mapping[str, Any], data: memoryview, source: str) -> torch.Tensor:
    _, dtype, _, _ = _TENSORS[name]
    try:
        st_dtype, shape, (begin, end) = spec["dtype"], [int(s) for s in spec["shape"]], spec["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise ManifestError(f"{source}: tensor {name!r} has a malformed header entry") from None
    if _ST_DTYPES_BACK.get(st_dtype) != dtype:
        raise ManifestError(f"{source}: tensor {name!r} has dtype {st_dtype}, schema {SCHEMA_VERSION} requires {_ST_DTYPES[dtype]}")
    count = 1
    for s in shape:
        count *= s
    itemsize = _NP_DTYPES[dtype].itemsize
    if not (0 <= begin <= end) or end - begin != count * itemsize:
        raise ManifestError(f"{source}: tensor {name!r} offsets [{begin}, {end}) do not match shape {shape}")
    if end > len(data):
        raise ManifestError(f"{source}: truncated: tensor {name!r} ends at byte {end} of {len(data)} data bytes")
    array = np.frombuffer(data[begin:end], dtype=_NP_DTYPES[dtype]).astype(_NP_DTYPES[dtype].newbyteorder("="))
    return torch.from_numpy(array.reshape(shape))
