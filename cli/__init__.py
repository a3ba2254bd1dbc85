"""``rolecall``: the umbrella command.

Each subcommand is a module with ``add_arguments(parser)`` and ``run(args) -> int``, listed in ``SUBCOMMANDS``;
only the chosen one is imported, and one whose module does not exist is left out.
"""

from rolecall.cli.command import (
    SUBCOMMANDS,
    Parser,
    available,
    build_parser,
    main,
    memory_line,
    out_of_memory,
    run_reporting_errors,
    script_parser,
)

__all__ = ["SUBCOMMANDS", "Parser", "available", "build_parser", "main", "memory_line", "out_of_memory",
           "run_reporting_errors", "script_parser"]
