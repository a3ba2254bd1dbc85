"""``rolecall merge A B --output OUT``: a layers manifest and a heads manifest of one model, combined."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("first", help="a manifest with a layers section (calibrate-delta) or a heads section")
    parser.add_argument("second", help="the other one")
    parser.add_argument("--output", "-o", required=True, help="where to write the merged manifest")


def same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (the same path, a link to it, or a hard link)."""
    pa, pb = Path(a), Path(b)
    if pa.resolve() == pb.resolve():
        return True
    try:
        return os.path.samefile(pa, pb)
    except OSError:  # one of them does not exist: not the same file
        return False


def load_verified(path: str, which: str):
    """Input ``path`` loaded with its content hash checked: the merged file gets a hash of its own, which must not
    cover content nothing verified, so an input without one is refused (one line naming it and the fix)."""
    from rolecall.core.manifest import RoleManifest, UnverifiedManifestError

    try:
        return RoleManifest.load(path)
    except UnverifiedManifestError as e:
        raise UnverifiedManifestError(f"{e}; rolecall merge writes a content hash over its inputs, so it takes only "
                                      f"inputs whose hash it verified (the {which} one has none)") from None


def run(args: argparse.Namespace) -> int:
    """Checks the output path (writable, and none of the inputs: the merge would replace an input it read) before
    the inputs are read; then the inputs, each with a verified content hash."""
    from rolecall.core.atomic import check_writable
    from rolecall.core.manifest.interop import merge_manifests

    check_writable(args.output, "--output")  # refused before the inputs are read
    for which, given in (("first", args.first), ("second", args.second)):
        if same_file(args.output, given):
            raise ValueError(f"--output {args.output}: that is the {which} input ({given}); write the merged "
                             "manifest to another path (then move it over the input if you mean to replace it)")
    merged = merge_manifests(load_verified(args.first, "first"), load_verified(args.second, "second"))
    merged.save(args.output)
    print(f"wrote {args.output} ({', '.join(merged.sections)})", file=sys.stderr)
    return 0
