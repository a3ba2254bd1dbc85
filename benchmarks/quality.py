"""Quality of every decode policy at a grid of token budgets, for one model: tables, plots, JSON.

    python -m benchmarks.quality --model smollm2-135m --alphabet digits --passkey-words 5 \\
        --delta artifacts/smollm2-135m/smollm2-135m.delta.safetensors \\
        --heads hardkuma=artifacts/smollm2-135m/heads.safetensors \\
        --lethe artifacts/smollm2-135m/smollm2-135m.delta.safetensors --out results/quality-smollm2

The same flags, checks and output files as ``rolecall grid`` (:mod:`rolecall.cli.grid`; the cells, resuming and
the summary are :mod:`rolecall.eval.grid`'s), under this script's name: its refusals start ``quality.py: error:``
and ``COMMAND.txt`` records ``python -m benchmarks.quality ...``.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from rolecall.cli import run_reporting_errors, script_parser
from rolecall.cli.grid import add_arguments, check_arguments, run_checked

PROG = Path(__file__).name


def parse_args(argv: list[str]):
    """The flags, checked as ``rolecall grid`` checks them (one line, exit status 2, before anything is read or
    loaded); sets ``grid`` (the :class:`rolecall.eval.grid.Grid`) and ``command_line`` (what ``COMMAND.txt``
    records)."""
    parser = script_parser(PROG, __doc__.split("\n\n")[0], add_arguments)
    args = parser.parse_args(argv)
    check_arguments(args, parser)
    args.command_line = shlex.join(["python", "-m", "benchmarks.quality", *argv])
    return args


def main(argv: list[str] | None = None) -> int:
    """Refusals in one line, exit status 2: bad flags from the parser, the rest (a grid made with other settings,
    a missing corpus, an out-of-memory GPU) from the run."""
    return run_reporting_errors(PROG, run_checked, parse_args(sys.argv[1:] if argv is None else list(argv)))


if __name__ == "__main__":
    sys.exit(main())
