"""``rolecall``: the umbrella command. Each subcommand is a module with ``add_arguments(parser)`` and
``run(args) -> int``, listed in ``SUBCOMMANDS``; a module that is not importable is left out of the help."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("runtime.inspect", "print a manifest's identity, provenance and role map"),
    "calibrate": ("calibrate.cli", "record attention and choose Δ-layers and Lethe budgets (= calibrate-delta)"),
    "train": ("train.cli", "learn retrieval heads with HardKuma gates (= train-heads)"),
    "decode": ("runtime.decode_cli", "generate with a manifest and a sparse-decode policy"),
    "eval": ("runtime.eval_cli", "compare policies on passkey prompts"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolecall", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name):
                continue  # not built in this version
            raise
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, OSError) as e:  # our errors are one line that names the problem and the fix
        print(f"rolecall {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
