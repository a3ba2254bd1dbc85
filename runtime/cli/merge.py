"""``rolecall merge A B --output OUT``: a layers manifest and a heads manifest of one model, combined."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("first", help="a manifest with a layers section (calibrate-delta) or a heads section")
    parser.add_argument("second", help="the other one")
    parser.add_argument("--output", "-o", required=True, help="where to write the merged manifest")


def run(args: argparse.Namespace) -> int:
    from runtime.atomic import check_writable
    from runtime.manifest import RoleManifest
    from runtime.manifest.interop import merge_manifests

    check_writable(args.output, "--output")  # refused before the inputs are read
    merged = merge_manifests(RoleManifest.load(args.first), RoleManifest.load(args.second))
    merged.save(args.output)
    print(f"wrote {args.output} ({', '.join(merged.sections)})", file=sys.stderr)
    return 0
