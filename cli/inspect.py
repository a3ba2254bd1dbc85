"""``rolecall inspect MANIFEST``: identity, provenance, metrics and a terminal role map of a manifest."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolecall.core.manifest import RoleManifest

SLIDING_GLYPH = "w"  # a sliding-window layer: its own windowed attention under every policy, whatever its role


def role_map(manifest: RoleManifest) -> str:
    """One line per layer: the layer role, its numbers, and one glyph per KV head (``w`` on sliding layers)."""
    from rolecall.core.manifest import (
        HEAD_ROLE_RETRIEVAL,
        HEAD_ROLE_SPARSE,
        LAYER_ROLE_FULL,
        LAYER_ROLE_SELECT,
        LAYER_ROLE_SPARSE,
    )

    layer_glyphs = {LAYER_ROLE_FULL: "F", LAYER_ROLE_SELECT: "Δ", LAYER_ROLE_SPARSE: "·"}
    head_glyphs = {HEAD_ROLE_RETRIEVAL: "R", HEAD_ROLE_SPARSE: "·"}
    m = manifest.model
    sliding = set(m.sliding_layers or [])
    lines = []
    has_layers, has_heads = manifest.layer_role is not None, manifest.head_role is not None
    header = ["layer"]
    if has_layers:
        header += ["role", "shift ", "budget"]
    if has_heads:
        header += [f"heads (R retrieval, · sparse; {m.num_kv_heads} KV heads)"]
    if sliding:
        header += ["(w: sliding window)"]
    lines.append("  ".join(header))
    for layer in range(m.num_layers):
        row = [f"{layer:>5}"]
        if has_layers:
            glyph = SLIDING_GLYPH if layer in sliding else layer_glyphs[int(manifest.layer_role[layer])]
            row.append(f"{glyph:>4}")
            shift = manifest.layer_shift[layer] if manifest.layer_shift is not None else None
            budget = manifest.layer_budget[layer] if manifest.layer_budget is not None else None
            row.append(f"{float(shift):6.3f}" if shift is not None and layer not in sliding else "     -")
            row.append(f"{float(budget):6.3f}" if budget is not None and layer not in sliding else "     -")
        if has_heads:
            row.append(SLIDING_GLYPH * m.num_kv_heads if layer in sliding
                       else "".join(head_glyphs[int(r)] for r in manifest.head_role[layer]))
        lines.append("  ".join(row))
    return "\n".join(lines)


def scalar_metrics(metrics: dict) -> dict:
    """The single numbers and words of ``metrics``, per section in a merged manifest (``{"layers": {...}, "heads":
    {...}}``); arrays are left to ``--json``."""
    shown: dict = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float, str)):
            shown[key] = value
        elif isinstance(value, dict) and (inner := scalar_metrics(value)):
            shown[key] = inner
    return shown


def has_values(doc: dict) -> bool:
    """Whether ``doc`` holds anything but (nested) empty mappings."""
    return any(not isinstance(v, dict) or has_values(v) for v in doc.values())


def describe(manifest: RoleManifest, path: str = "") -> str:
    m = manifest.model
    out = [
        f"manifest     {path}",
        f"model        {m.name or '(unnamed)'}" + (f" @ {m.revision}" if m.revision else ""),
        f"shape        {m.num_layers} layers, {m.num_heads} query heads, {m.num_kv_heads} KV heads, head dim {m.head_dim}",
        f"config hash  {m.config_sha256 or '(none)'}",
        *([f"sliding      {m.sliding_layers} (their own windowed attention under every policy)"]
          if m.sliding_layers else []),
        f"sections     {', '.join(manifest.sections) or '(none)'}",
        f"made by      rolecall {manifest.rolecall_version or '?'}",
    ]
    if manifest.layer_role is not None:
        out.append(f"Δ-layers     {manifest.delta_layers}")
    if manifest.head_role is not None:
        # layer 0 is all retrieval by construction (its heads have no earlier layer to inherit from): counted
        # apart, so the learned count reads as the training target and the manifest's metrics give it
        heads = manifest.retrieval_heads
        learned = sum(1 for layer, _ in heads if layer > 0)
        out.append(f"retrieval    {learned} of {(m.num_layers - 1) * m.num_kv_heads} KV heads past layer 0, "
                   f"{len(heads)} of {m.num_layers * m.num_kv_heads} with layer 0's {len(heads) - learned}")
    if manifest.data:
        out.append(f"data         {json.dumps(manifest.data, sort_keys=True)}")
    if manifest.config:
        out.append(f"config       {json.dumps(manifest.config, sort_keys=True)}")
    scalars = scalar_metrics(manifest.metrics)
    if scalars:
        out.append(f"metrics      {json.dumps(scalars, sort_keys=True)}")
    elif has_values(manifest.metrics):
        out.append("metrics      (arrays only; --json shows them)")
    if manifest.recommended:
        from rolecall.core.manifest.recommended import evidence_text, setting_text

        r = manifest.recommended
        why = evidence_text(r.get("evidence", {}))
        out.append(f"recommended  {setting_text(r['policy'], r.get('params', {}))}" + (f" ({why})" if why else ""))
    for key, value in sorted(manifest.extra.items()):
        out.append(f"{key:<12} {value}")
    if manifest.sections:
        out += ["", role_map(manifest)]
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="path to a .safetensors role manifest")
    parser.add_argument("--model", help="also check that the manifest fits this model (alias, HF id or folder)")
    parser.add_argument("--json", action="store_true", help="print the metadata as JSON instead of a table")
    parser.add_argument("--plot", metavar="PNG", help="also draw the role map and the present sections into PNG")
    parser.add_argument("--verify", action="store_true",
                        help="check the content hash and that the file is in canonical form; exit 1 if the file "
                        "is corrupted, has no content hash to check, or is not canonical")


def verify(raw: bytes, path: str) -> tuple[bool, str]:
    """(ok, message) for the bytes ``raw`` of the file at ``path``. Loading checks the content hash; a rolecall
    file must also re-serialise to its own bytes."""
    from rolecall.core.manifest import (
        CONTENT_HASH_KEY,
        RoleManifest,
        UnverifiedManifestWarning,
        read_metadata,
    )

    with warnings.catch_warnings():  # no hash: said below, in this command's words
        warnings.simplefilter("ignore", UnverifiedManifestWarning)
        manifest = RoleManifest.from_bytes(raw, source=path, strict=False)  # raises ManifestError on any corruption
    digest = read_metadata(raw).get(CONTENT_HASH_KEY)
    if digest is None:  # nothing was checked: an edited file whose hash was removed passes no verification
        return False, ("not verified: the file has no content hash to check (written by another tool, or edited "
                       "and its hash removed); if its content is right, re-save it with rolecall "
                       "(RoleManifest.load(path, strict=False).save(path)) to add one")
    if manifest.to_bytes() != raw:
        return False, "content hash matches but the file is not in canonical form; re-save it with rolecall"
    return True, f"verified: content hash {digest} matches and the file is canonical"


def load_described(path: str) -> RoleManifest:
    """The manifest to describe: one without a content hash too (looking at it is harmless), with one line on
    stderr saying it was not verified; a corrupted one is refused as everywhere."""
    from rolecall.core.manifest import RoleManifest, UnverifiedManifestWarning

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", UnverifiedManifestWarning)
        manifest = RoleManifest.load(path, strict=False)
    for warning in said:
        if issubclass(warning.category, UnverifiedManifestWarning):
            print(f"rolecall inspect: note: {warning.message}; other commands refuse it", file=sys.stderr)
    return manifest


def run(args: argparse.Namespace) -> int:
    from rolecall.core.atomic import check_writable
    from rolecall.core.manifest import ManifestError, read_manifest_file

    if args.plot:
        check_writable(args.plot, "--plot")  # refused before anything is printed
    if args.verify:
        raw = read_manifest_file(args.manifest)  # a missing path or a folder: a usage error (exit 2), not a failed check
        try:
            ok, message = verify(raw, args.manifest)
        except ManifestError as e:  # corrupted or foreign: a failed verification (exit 1, as --help says)
            ok, message = False, f"not verified: {e}"
        print(message, file=sys.stdout if ok else sys.stderr)
        if not ok:
            return 1
    manifest = load_described(args.manifest)
    if args.json:
        print(json.dumps(manifest.metadata(), indent=2, sort_keys=True))
    else:
        print(describe(manifest, args.manifest))
    if args.plot:
        from rolecall.core.manifest.plots import plot_manifest

        print(f"\nplot: {plot_manifest(manifest, args.plot)}")
    if args.model:
        from rolecall.core.models import load_config

        manifest.validate_for(load_config(args.model))
        print(f"\nfits {args.model}: yes")
    return 0
