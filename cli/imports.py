"""``rolecall import FILE --format F --model M --output OUT``."""

from __future__ import annotations

import argparse
import sys

from rolecall.core.atomic import check_writable
from rolecall.core.manifest.interop import FORMATS, check_source, import_manifest
from rolecall.core.models import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="DuoAttention pattern folder or .tsv, rolecall JSON, or a layer list")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--model", required=True, help="the model the roles are for (alias, HF id or folder)")
    parser.add_argument("--output", "-o", required=True, help="where to write the manifest (.safetensors)")
    rule = parser.add_mutually_exclusive_group()
    rule.add_argument("--threshold", type=float, default=None, help="duo: retrieval where gate > threshold (default 0.5)")
    rule.add_argument("--sparsity", type=float, default=None, help="duo: fraction of heads made sparse (DuoAttention's rule)")
    rule.add_argument("--num-retrieval", type=int, default=None, help="duo: keep this many heads with the largest gates")


def run(args: argparse.Namespace) -> int:
    rule = {k: v for k, v in (("threshold", args.threshold), ("sparsity", args.sparsity),
                               ("num_retrieval", args.num_retrieval)) if v is not None}
    if rule and args.format != "duo":
        raise ValueError("--threshold/--sparsity/--num-retrieval apply to --format duo only")
    check_writable(args.output, "--output")  # refused before the model's config and the source are read
    check_source(args.source, args.format)
    manifest = import_manifest(args.source, args.format, load_config(args.model), name=args.model, **rule)
    manifest.save(args.output)
    print(f"wrote {args.output} ({', '.join(manifest.sections)})", file=sys.stderr)
    return 0
