"""One way to read settings: dataclass defaults, then a config file, then flags — the same errors everywhere.

``read_config(name_or_path, kind, folder)`` reads a YAML (or, by its suffix, JSON) mapping from a file or from
the one of that name shipped in ``configs/<folder>/``; ``layered(cls, *layers, what=...)`` merges mappings over
a dataclass's defaults, later layers winning, ``None`` values skipped (an unset flag), unknown keys refused.
Calibration (``configs/calibrate/``), training (``configs/train/``) and DeepSpeed (``configs/deepspeed/``) all
go through them, so a config problem reads the same in every command.

A command's folder holds ``<model>.yaml`` (that model's defaults, read for ``--model <model>``) and
``<model>.<variant>.yaml`` (a named variant, read with ``--config <model>.<variant>``).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file or setting that cannot be used; the message says which and how to fix it."""


def shipped(folder: str) -> dict[str, Path]:
    """The configs that ship in ``configs/<folder>/``, by name (the file name without its suffix)."""
    root = importlib.resources.files("rolecall.configs") / folder
    return {p.name.rsplit(".", 1)[0]: Path(str(p)) for p in root.iterdir()
            if p.name.endswith((".yaml", ".yml", ".json"))}


def shipped_path(name: str, kind: str, folder: str) -> Path:
    """The file of the config named ``name`` in ``configs/<folder>/``, or a one-line :class:`ConfigError` listing
    the names there are."""
    there = shipped(folder)
    if name not in there:
        raise ConfigError(f"{kind} {name!r}: no such file, and not one of configs/{folder}/ "
                          f"({', '.join(sorted(there))})")
    return there[name]


def read_config(name_or_path: str | Path, kind: str, folder: str) -> dict[str, Any]:
    """The mapping in ``name_or_path``: a file, or the name of one in ``configs/<folder>/``."""
    path = Path(name_or_path)
    if not path.is_file():
        path = shipped_path(str(name_or_path), kind, folder)
    return read_mapping(path, kind)


def read_mapping(path: Path, what: str, fix: str = "fix the file", error: type[Exception] = ConfigError,
                 json_only: bool = False, shape: str = "a mapping of option: value") -> dict[str, Any]:
    """The mapping in the JSON (``.json`` or ``json_only``) or YAML file ``path``, or ``error`` in one line: ``what``
    and the path, what is wrong, ``fix``."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise error(f"{what} {path}: not a text file; {fix}") from None
    except (FileNotFoundError, IsADirectoryError):
        raise error(f"{what} {path}: {'a folder' if path.is_dir() else 'no such file'}; {fix}") from None
    try:
        doc = json.loads(text) if json_only or path.suffix == ".json" else (yaml.safe_load(text) or {})
    except json.JSONDecodeError as e:
        raise error(f"{what} {path}: not valid JSON ({e.msg} at line {e.lineno}); {fix}") from None
    except yaml.YAMLError as e:
        raise error(f"{what} {path}: not valid YAML ({str(e).splitlines()[0]}); {fix}") from None
    if not isinstance(doc, dict):
        raise error(f"{what} {path}: expected {shape}, got {type(doc).__name__}; {fix}")
    return doc


def layered(cls: type, *layers: dict[str, Any] | None, what: str) -> Any:
    """``cls`` (a dataclass) from its defaults and ``layers`` in order; ``None`` values are skipped."""
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    merged: dict[str, Any] = {}
    for layer in layers:
        unknown = sorted(set(layer or {}) - known)
        if unknown:
            noun = "option" if len(unknown) == 1 else "options"
            raise ConfigError(f"{what}: unknown {noun} {', '.join(map(repr, unknown))}; known options: "
                              f"{', '.join(sorted(known))}")
        merged.update({k: v for k, v in (layer or {}).items() if v is not None})
    return cls(**merged)
