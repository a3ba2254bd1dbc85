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

Reading refuses, in one line naming the file, the field and the fix (:class:`ManifestError`, a ``ValueError``):
a path that is no regular file (missing, a folder, a FIFO, a device), a header length the file cannot hold
(checked against the file's size before more than the 8-byte length and the header is read, so a large file
of something else is never read whole), another format, tensors whose shapes do not match the model identity,
role values outside their sets (``layers.role`` in {0, 1, 2}, ``heads.role`` in {0, 1}), Lethe budgets
(``layers.budget``) that are not finite fractions in (0, 1], a content hash that does not match the content,
and, unless ``strict=False``, a file without a content hash (nothing shows it is as written; loading it with
``strict=False`` warns so).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
import warnings
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
_JSON_KEYS = ("config", "data", "metrics", "recommended")  # metadata values that hold JSON documents
_MAX_HEADER = 64 * 1024 * 1024
_MADE_BY = "give a manifest that calibrate-delta, train-heads, rolecall merge or rolecall import wrote"
CONTENT_HASH_KEY = "content_sha256"  # metadata key; checked on load when present


class ManifestError(ValueError):
    """A file is not a valid rolecall manifest (the message says what is wrong and how to fix it)."""


class ManifestMismatchError(ManifestError):
    """A manifest was made for another model; the message names the field and both values."""


class UnverifiedManifestError(ManifestError):
    """A manifest without a content hash, loaded with ``strict=True``: nothing shows its content is as written."""


class UnverifiedManifestWarning(UserWarning):
    """A manifest without a content hash was loaded with ``strict=False``: its content was not verified."""


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
        from rolecall.core.models import sliding_layers

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
    # the decode setting ``rolecall tune`` chose for this model and workload: {"policy", "params", "evidence"}
    recommended: dict[str, Any] = field(default_factory=dict)
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
        _check_recommended(self.recommended)
        if self.rolecall_version is None:
            from rolecall import __version__

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
        """The identity's counts, every tensor's shape against them, and the values each field may hold (role
        values in their sets, Lethe budgets finite fractions in (0, 1]), each refused naming the field."""
        m = self.model
        for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(m, key)
            if not isinstance(value, int) or value <= 0:
                raise ManifestError(f"model.{key} must be a positive integer, got {value!r}")
        if m.num_heads % m.num_kv_heads:
            raise ManifestError(f"model.num_heads ({m.num_heads}) is not a multiple of model.num_kv_heads ({m.num_kv_heads})")
        outside = [i for i in m.sliding_layers or [] if not 0 <= i < m.num_layers]
        if outside:
            raise ManifestError(f"model.sliding_layers holds layer {outside[0]}, but the model has {m.num_layers} "
                                f"layers (0-{m.num_layers - 1}); re-create the manifest for this model")
        for name, (attr, _, kind, _) in _TENSORS.items():
            t = getattr(self, attr)
            if t is None:
                continue
            want = {"L": (m.num_layers,), "LH": (m.num_layers, m.num_kv_heads)}.get(kind)
            ok = tuple(t.shape) == want if want else (t.dim() == 2 and t.shape[0] == m.num_layers and t.shape[1] >= 1)
            if not ok:
                expect = want if want else f"({m.num_layers}, B>=1)"
                raise ManifestError(f"{name} has shape {tuple(t.shape)}, expected {expect} for this model "
                                    f"({m.num_layers} layers, {m.num_kv_heads} KV heads)")
        _check_values("layers.role", self.layer_role, lambda t: (t >= 0) & (t <= 2),
                      "outside {0 full, 1 selection, 2 sparse}", "re-create the manifest (calibrate-delta, rolecall import)")
        _check_values("heads.role", self.head_role, lambda t: (t == 0) | (t == 1), "outside {0 sparse, 1 retrieval}",
                      "re-create the manifest (train-heads, rolecall import)")
        _check_values("layers.budget", self.layer_budget, lambda t: torch.isfinite(t) & (t > 0) & (t <= 1),
                      "not a fraction in (0, 1]: a Lethe budget is the share of the context a layer keeps",
                      "re-run calibrate-delta, or set it in (0, 1]")

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
            from rolecall.core.models import sliding_layers

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
        if self.rolecall_version:
            meta["rolecall_version"] = self.rolecall_version
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
        from rolecall.core.atomic import write_bytes

        return write_bytes(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike, strict: bool = True) -> RoleManifest:
        """The manifest at ``path`` (:func:`read_manifest_file`, then :meth:`from_bytes`); ``strict`` as there.
        ``path`` is a path (str or ``os.PathLike``); anything else is a :class:`ManifestError` naming its type. A
        folder that ``rolecall export --format hub`` wrote, or a Hub repo id in the local cache, reads its
        ``manifest.safetensors`` (:func:`rolecall.core.manifest.hub.resolve_manifest_path`)."""
        if not isinstance(path, (str, os.PathLike)):
            fix = "RoleManifest.from_bytes(data)" if isinstance(path, (bytes, bytearray, memoryview)) else "its path"
            raise ManifestError(f"a manifest is given by its path (str or os.PathLike) or as a RoleManifest, not a "
                                f"{type(path).__name__}; pass {fix}")
        return cls.from_bytes(read_manifest_file(path), source=str(path), strict=strict)

    @classmethod
    def from_bytes(cls, buf: bytes, source: str = "<bytes>", strict: bool = True) -> RoleManifest:
        """The manifest in ``buf``, every field checked (see the module's docstring); ``source`` names it in
        messages. A content hash that does not match is always refused; a file without one (another tool's, or
        edited and its hash removed) with ``strict`` (the default) too, as :class:`UnverifiedManifestError`, and
        with ``strict=False`` it loads with an :class:`UnverifiedManifestWarning` saying that it was not verified."""
        header, data = _parse(buf, source)
        meta = _check_format(header, source)
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
        specs = _tensor_specs(full_header, source)
        _check_data_length(specs, len(data), source)
        tensors = {_TENSORS[name][0]: _read_tensor(name, spec, data) for name, spec in specs.items()}
        unverified = _check_hash(buf, full_header, data, meta, source)
        listed = [s for s in meta.get("sections", "").split(",") if s]
        found = sorted({_TENSORS[n][3] for n in header})
        if sorted(listed) != found:
            raise ManifestError(f"{source}: metadata 'sections' lists {listed} but the file holds {found}")
        known = {f"model.{k}" for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "name", "revision",
                                         "config_sha256", "sliding_layers")} | {"format", "schema_version", "sections",
                                                              CONTENT_HASH_KEY,
                                                              "rolecall_version", *_JSON_KEYS}
        docs = {}
        for key in _JSON_KEYS:
            try:
                docs[key] = json.loads(meta[key]) if key in meta else {}
            except json.JSONDecodeError:
                raise ManifestError(f"{source}: metadata {key!r} is not valid JSON") from None
        try:  # the values, checked as any manifest's are, named with the file
            manifest = cls(model=model, **tensors, **docs,
                           rolecall_version=meta.get("rolecall_version", ""),
                           extra={k: v for k, v in meta.items() if k not in known})
        except ManifestError as e:
            raise type(e)(f"{source}: {e}") from None
        if unverified:
            if strict:
                raise UnverifiedManifestError(
                    f"{source}: {unverified}, so nothing shows its content is as written; if it is right, load it with "
                    "RoleManifest.load(path, strict=False) (and save it: that adds a hash)")
            warnings.warn(f"{source}: {unverified}; loaded without verification (strict=False)",
                          UnverifiedManifestWarning, stacklevel=3)
        return manifest

    # -- convenience -------------------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """The present tensors by their file names."""
        return {n: getattr(self, a) for n, (a, *_) in _TENSORS.items() if getattr(self, a) is not None}

    def equals(self, other: RoleManifest) -> bool:
        return self.to_bytes() == other.to_bytes()


_NOT_FILES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
              (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_manifest_file(path: str | os.PathLike) -> bytes:
    """The bytes of the manifest file at ``path``, each refusal one line (:class:`ManifestError`): a missing path,
    a folder, a FIFO, a device or a socket, named as such (before anything opens it: reading a FIFO would wait);
    then the 8-byte header length against the file's size, the header as a rolecall manifest's, and its tensors'
    extent against the file's size, before more than the length and the header is read (a large file of another
    kind is never read whole). A folder that ``rolecall export --format hub`` wrote, or a Hub repo id in the local
    cache, gives its ``manifest.safetensors`` (:func:`rolecall.core.manifest.hub.resolve_manifest_path`)."""
    from rolecall.core.manifest.hub import resolve_manifest_path

    path = Path(resolve_manifest_path(path))
    source = str(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such manifest file") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot read it ({e.strerror or e}); give the path of a manifest file you can "
                            "read") from None
    if stat.S_ISDIR(mode):
        raise ManifestError(f"{path}: a folder, not a manifest file; give the path of a manifest file (.safetensors)")
    kind = next((what for test, what in _NOT_FILES if test(mode)), None if stat.S_ISREG(mode) else "neither a file nor a folder")
    if kind:
        raise ManifestError(f"{path}: {kind}, not a manifest file; give the path of a manifest file (.safetensors)")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = f.read(8)
            n = _header_length(first, size, source)
            start = f.read(min(n, 1))  # an empty header (n = 0) is no JSON either
            _header_start(start, source)
            raw_header = start + f.read(n - 1)
            header = _header_json(raw_header, source)
            _check_format(header, source)
            _check_data_length(_tensor_specs(header, source), size - 8 - n, source)
            return first + raw_header + f.read()
    except OSError as e:
        raise ManifestError(f"{path}: cannot read it ({e.strerror or e}); give the path of a manifest file you can "
                            "read") from None


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


def _check_hash(buf: bytes, header: dict, data: bytes, meta: dict, source: str) -> str | None:
    """A file written by rolecall carries the hash of its content: refuse one whose content changed since. Returns
    why there is nothing to verify (no hash), or None when the hash was checked."""
    if CONTENT_HASH_KEY not in meta:
        if "rolecall_version" in meta:
            return f"written by rolecall but its {CONTENT_HASH_KEY!r} is missing (edited, and its hash removed)"
        return f"no content hash ({CONTENT_HASH_KEY!r}) to check: another tool wrote it, or it was edited"
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
    return None


def _check_recommended(recommended: Any) -> None:
    """A recommended setting is empty or ``{"policy": name, "params": {...}, "evidence": {...}}``."""
    if not recommended:
        return
    ok = (isinstance(recommended, dict) and isinstance(recommended.get("policy"), str) and recommended["policy"]
          and isinstance(recommended.get("params", {}), dict) and isinstance(recommended.get("evidence", {}), dict))
    if not ok:
        raise ManifestError(f"recommended must be {{'policy': name, 'params': {{...}}, 'evidence': {{...}}}}, got "
                            f"{recommended!r:.80}; re-run rolecall tune to write it")


def _check_values(name: str, t: torch.Tensor | None, ok, what: str, fix: str) -> None:
    """Refuse the first value of field ``name`` that ``ok`` (tensor → bool tensor) rejects, naming where it is."""
    if t is None:
        return
    bad = (~ok(t)).nonzero()
    if len(bad):
        where = ", ".join(str(int(i)) for i in bad[0])
        value = t[tuple(bad[0].tolist())].item()
        shown = repr(value) if isinstance(value, int) or math.isfinite(value) else str(value)
        raise ManifestError(f"{name}[{where}] is {shown}, {what}; {fix}")


def _header_length(first: bytes, size: int, source: str) -> int:
    """The header length the first 8 bytes give, checked against ``size``, the bytes the file (or buffer) holds."""
    if size < 8 or len(first) < 8:
        raise ManifestError(f"{source}: file is {size} bytes, too short to be a manifest (truncated?)")
    (n,) = struct.unpack("<Q", first[:8])
    if n > _MAX_HEADER:
        if first[:1] in (b"{", b"["):  # an export, or another tool's roles
            raise ManifestError(f"{source}: not a rolecall manifest but JSON; make one from it with `rolecall import "
                                f"{source} --format json --model MODEL -o FILE.safetensors` (`--format layers` for a list "
                                "of layers)")
        raise ManifestError(f"{source}: not a rolecall manifest (its first 8 bytes give a header of {n:,} bytes, "
                            f"more than the {_MAX_HEADER:,} a manifest's may take); {_MADE_BY}")
    if 8 + n > size:
        raise ManifestError(f"{source}: truncated: header needs {n} bytes but only {size - 8} follow")
    return n


def _header_start(start: bytes, source: str) -> None:
    """A header is a JSON object: refused at its first byte (before the rest is read) when that is not ``{``."""
    if start[:1] != b"{":
        raise ManifestError(f"{source}: not a rolecall manifest (header is not JSON)")


def _header_json(raw: bytes | memoryview, source: str) -> dict[str, Any]:
    _header_start(bytes(raw[:1]), source)
    try:
        header = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ManifestError(f"{source}: not a rolecall manifest (header is not JSON)") from None
    if not isinstance(header, dict):
        raise ManifestError(f"{source}: not a rolecall manifest (header is not a JSON object)")
    return header


def _check_format(header: dict[str, Any], source: str) -> dict[str, Any]:
    """The header's metadata, when it says this is a rolecall manifest; else refused (weights, another tool's file)."""
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ManifestError(f"{source}: a safetensors file but not a rolecall manifest (its metadata 'format' is "
                            f"{found!r}, not {FORMAT!r}: model weights, or another tool's file); {_MADE_BY}")
    return meta


def _tensor_specs(header: Mapping[str, Any], source: str) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """Each tensor's dtype, shape and data offsets from the header, checked: a known name, the dtype the schema
    gives it, offsets spanning exactly its shape's bytes."""
    specs = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if name not in _TENSORS:
            raise ManifestError(f"{source}: unknown tensor {name!r} (schema {SCHEMA_VERSION} knows {sorted(_TENSORS)})")
        _, dtype, _, _ = _TENSORS[name]
        try:
            st_dtype, shape, (begin, end) = spec["dtype"], [int(s) for s in spec["shape"]], spec["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise ManifestError(f"{source}: tensor {name!r} has a malformed header entry") from None
        if _ST_DTYPES_BACK.get(st_dtype) != dtype:
            raise ManifestError(f"{source}: tensor {name!r} has dtype {st_dtype}, schema {SCHEMA_VERSION} requires "
                                f"{_ST_DTYPES[dtype]}")
        count = 1
        for s in shape:
            count *= s
        if min(shape, default=0) < 0 or not (0 <= begin <= end) or end - begin != count * _NP_DTYPES[dtype].itemsize:
            raise ManifestError(f"{source}: tensor {name!r} offsets [{begin}, {end}) do not match shape {shape}")
        specs[name] = (dtype, shape, begin, end)
    return specs


def _check_data_length(specs: Mapping[str, tuple], length: int, source: str) -> None:
    """The data after the header holds exactly the tensors' bytes: none missing (truncated), none after the last."""
    end = max((spec[3] for spec in specs.values()), default=0)
    if length < end:
        name = max(specs, key=lambda n: specs[n][3])
        raise ManifestError(f"{source}: truncated: tensor {name!r} ends at byte {end} of {length} data bytes")
    if length > end:
        raise ManifestError(f"{source}: {length - end:,} bytes follow its last tensor (a manifest's tensors fill its "
                            f"data exactly): not a rolecall manifest, or one with something appended; {_MADE_BY}")


def _parse(buf: bytes, source: str) -> tuple[dict[str, Any], memoryview]:
    """The header and the data of a manifest's bytes."""
    n = _header_length(buf[:8], len(buf), source)
    return _header_json(memoryview(buf)[8 : 8 + n], source), memoryview(buf)[8 + n :]


def _read_tensor(name: str, spec: tuple[torch.dtype, list[int], int, int], data: memoryview) -> torch.Tensor:
    """A tensor's values from the data, by its checked spec (:func:`_tensor_specs`, :func:`_check_data_length`)."""
    dtype, shape, begin, end = spec
    array = np.frombuffer(data[begin:end], dtype=_NP_DTYPES[dtype]).astype(_NP_DTYPES[dtype].newbyteorder("="))
    return torch.from_numpy(array.reshape(shape))
