"""The ``rolecall`` command: its parser (:class:`Parser`, one-line usage errors), the subcommands it finds, and
:func:`main`, which runs the chosen one and reports its errors in one line."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import shlex
import sys
from collections.abc import Callable
from typing import Any, NoReturn

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("rolecall.cli.inspect", "print a manifest's identity, provenance and role map"),
    "calibrate": ("rolecall.calibrate.cli", "record attention and choose Δ-layers and Lethe budgets (= calibrate-delta)"),
    "train": ("rolecall.train.cli", "learn retrieval heads with HardKuma gates (= train-heads)"),
    "decode": ("rolecall.cli.decode", "generate with a manifest and a sparse-decode policy"),
    "eval": ("rolecall.cli.eval", "compare policies on passkey, RULER-style, LongBench or reasoning prompts"),
    "export": ("rolecall.cli.export", "write a manifest as a DuoAttention pattern, JSON or a layer list"),
    "import": ("rolecall.cli.imports", "make a manifest from a DuoAttention pattern, JSON or a layer list"),
    "merge": ("rolecall.cli.merge", "combine a layers manifest and a heads manifest of one model"),
    "plan": ("rolecall.cli.plan", "the memory plan of serving a model: weights, KV pool in pages, maximum concurrency"),
    "serve": ("rolecall.cli.serve", "an OpenAI-compatible HTTP server with continuous batching"),
    "grid": ("rolecall.cli.grid", "every policy at a grid of token budgets on one suite: tables, plots, resumable cells"),
    "tune": ("rolecall.cli.tune", "choose the cheapest setting within a stated drop of full attention, into the manifest"),
}


class Parser(argparse.ArgumentParser):
    """argparse with a usage error as one line, like every other refusal of the project's commands: argparse's
    own message (the argument, the value and what it accepts), then where the options are listed. Subcommand
    parsers are of this class too (``add_subparsers`` takes the parent's class). A value that starts with a minus
    and a digit (``--lengths -100,200``) is a value, as argparse takes ``-100`` alone, so that its own check refuses
    it instead of argparse missing an argument."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")  # as newer Pythons' argparse has it, lists included

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (`{self.prog} --help` lists the options)\n")

    def counts(self, value: str, flag: str, what: str, low: int = 1) -> list[int]:
        """``value``, comma-separated, as whole numbers of at least ``low``, or a usage error in one line naming
        ``flag``: what it takes (``what``) and the value given."""
        try:
            numbers = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            self.error(f"{flag} takes comma-separated {what}, got {value!r}")
        if not numbers or min(numbers) < low:
            self.error(f"{flag} takes comma-separated {what} of at least {low} each, got {value!r}")
        return numbers

    def names(self, value: str, flag: str, known, none_ok: str | None = None) -> list[str]:
        """``value``, comma-separated, as names each of ``known``, or a usage error in one line naming ``flag``,
        the names it does not know (or that none was given: allowed where ``none_ok`` says when, and that is
        the case) and the known ones."""
        names = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not (names or none_ok):
            self.error(f"{flag}: {'unknown ' + ', '.join(unknown) if unknown else 'none given'}; known: "
                       f"{', '.join(known)}")
        return names

    def check_writable(self, path: str | None, flag: str, folder: bool = False) -> None:
        """An output ``path`` given to ``flag`` that is written after the work (``folder``: a folder written into),
        refused now as a usage error (:func:`rolecall.core.atomic.check_writable`); nothing when the flag was left out."""
        from rolecall.core.atomic import check_writable

        if path:
            try:
                check_writable(path, flag, folder=folder)
            except ValueError as e:
                self.error(str(e))


def script_parser(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None]) -> Parser:
    """The parser of a command run under a name of its own (``calibrate-delta``, ``train-heads``,
    ``benchmarks/quality.py``): a :class:`Parser` named ``prog`` with the arguments ``add_arguments`` gives it (the
    function that gives the ``rolecall`` subcommand the same ones)."""
    parser = Parser(prog=prog, description=description)
    add_arguments(parser)
    return parser


def available() -> dict[str, tuple[str, str]]:
    """The subcommands whose module exists (found without importing it, so ``--help`` stays fast)."""
    return {name: entry for name, entry in SUBCOMMANDS.items() if importlib.util.find_spec(entry[0]) is not None}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with ``only``, just that subcommand's module is imported and given its arguments (``""``:
    none, for the top-level help and its errors, which list the subcommands from :data:`SUBCOMMANDS` alone)."""
    parser = Parser(
        prog="rolecall",
        description="Find which layers and heads need full attention, and ship them as role manifests.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in available().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only in (None, name):
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def run_reporting_errors(prog: str, run: Callable[[Any], int | None], args: argparse.Namespace | None) -> int:
    """Run a command; our errors (one line naming the problem and the fix) print as such, exit status 2."""
    try:
        return int(run(args) or 0)
    except BrokenPipeError:  # output piped into `head` and closed: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not out_of_memory(e):
            raise
        print(f"{prog}: error: {memory_line()}", file=sys.stderr)
        return 2


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is torch's out-of-memory error (torch is not imported for it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


def memory_line() -> str:
    """One line for a GPU that ran out of memory: what this process and the others held, and the fixes."""
    import torch

    held = ""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        ours = torch.cuda.memory_reserved()
        others = max(0, total - free - ours)
        held = (f" (this process held {ours / 2**30:.1f} of the GPU's {total / 2**30:.1f} GiB, other processes "
                f"{others / 2**30:.1f} GiB)")
    return (f"out of GPU memory{held}; free the GPU or ask for less at once (a smaller --batch-size, shorter "
            "prompts or fewer new tokens); files already written are kept, and a rerun of a command that resumes "
            "(quality grids, train-heads) continues from them")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(chosen if chosen in SUBCOMMANDS else "").parse_args(argv)
    args.command_line = shlex.join(["rolecall", *argv])  # as given, for a command that records it (grid)
    return run_reporting_errors(f"rolecall {args.command}", args._run, args)


if __name__ == "__main__":
    sys.exit(main())
