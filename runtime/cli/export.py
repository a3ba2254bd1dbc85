"""``rolecall export MANIFEST --format F --output OUT``."""

from __future__ import annotations

import argparse
import sys

from runtime.atomic import check_writable
from runtime.manifest import RoleManifest
from runtime.manifest.interop import FORMATS, export_manifest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="a rolecall manifest (.safetensors)")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="duo: DuoAttention pattern folder; json: everything as JSON; layers: full/selection layer list")
    parser.add_argument("--output", "-o", required=True, help="output folder (duo) or file (json, layers)")
    parser.add_argument("--sink-size", type=int, default=64, help="duo: sink tokens written to config.json")
    parser.add_argument("--recent-size", type=int, default=256, help="duo: recent tokens written to config.json")


def run(args: argparse.Namespace) -> int:
    check_writable(args.output, "--output", folder=args.format == "duo")  # refused before the manifest is read
    manifest = RoleManifest.load(args.manifest)
    out = export_manifest(manifest, args.format, args.output, sink_size=args.sink_size, recent_size=args.recent_size)
    print(f"wrote {args.format} export of {args.manifest} to {out}", file=sys.stderr)
    return 0
