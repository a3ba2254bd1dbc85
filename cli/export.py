"""``rolecall export MANIFEST --format F --output OUT``."""

from __future__ import annotations

import argparse
import sys

from rolecall.core.atomic import check_writable
from rolecall.core.manifest import RoleManifest
from rolecall.core.manifest.interop import FORMATS, export_manifest

CHOICES = (*FORMATS, "hub")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="a rolecall manifest (.safetensors)")
    parser.add_argument("--format", required=True, choices=CHOICES,
                        help="duo: DuoAttention pattern folder; json: everything as JSON; layers: full/selection layer "
                             "list; hub: a folder for huggingface-cli upload (manifest, model card, layer list, duo)")
    parser.add_argument("--output", "-o", required=True, help="output folder (duo, hub) or file (json, layers)")
    parser.add_argument("--base-model", default=None, help="hub: the model the manifest is for (alias, Hugging Face "
                        "id or folder; default the name the manifest records), checked against the manifest")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="hub: run code from the base model's folder to read its config")
    parser.add_argument("--sink-size", type=int, default=64, help="duo: sink tokens written to config.json")
    parser.add_argument("--recent-size", type=int, default=256, help="duo: recent tokens written to config.json")


def run(args: argparse.Namespace) -> int:
    check_writable(args.output, "--output", folder=args.format in ("duo", "hub"))  # before the manifest is read
    if args.format == "hub":
        return _hub(args)
    manifest = RoleManifest.load(args.manifest)
    out = export_manifest(manifest, args.format, args.output, sink_size=args.sink_size, recent_size=args.recent_size)
    print(f"wrote {args.format} export of {args.manifest} to {out}", file=sys.stderr)
    return 0


def _hub(args: argparse.Namespace) -> int:
    from rolecall.core.manifest import read_manifest_file
    from rolecall.core.manifest.hub import export_hub
    from rolecall.core.models import load_config

    raw = read_manifest_file(args.manifest)  # a hub folder again: its manifest.safetensors
    manifest = RoleManifest.from_bytes(raw, source=args.manifest)  # verified before anything is written
    base = args.base_model or manifest.model.name
    if not base:
        raise ValueError("--base-model is needed: the manifest records no model name; pass the model it is for")
    config = load_config(base, trust_remote_code=args.trust_remote_code)
    out = export_hub(manifest, raw, args.output, base, config)
    print(f"wrote hub folder {out} for {base}: upload it with huggingface-cli upload <repo> {out}", file=sys.stderr)
    return 0
