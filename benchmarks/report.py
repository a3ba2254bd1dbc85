"""What the benchmark scripts share: their checks of numeric flags, the reports they read (a quality grid's
``summary.json``, a ``decode.py`` JSON), the rows they can pair, and what they write last (their JSON, their
table as Markdown, the table printed, their figures). The numeric-flag check, a grid row's paired scores and the
figure writer are the package's (``rolecall.cli.common``, ``rolecall.eval.grid_tables``, ``rolecall.eval.grid_plots``),
named here for the scripts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rolecall.cli.common import at_least as at_least
from rolecall.core import atomic
from rolecall.eval.grid_plots import save_figure as save_figure
from rolecall.eval.grid_tables import pairable_scores as pairable_scores


def read_report(path: Path, flag: str, fix: str) -> dict[str, Any]:
    """The JSON report at ``path`` (an object with a ``rows`` list), given through ``flag``; a file that is
    missing, unreadable, not JSON or without rows is a ``ValueError`` in one line naming the flag, the file and
    ``fix``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{flag}: no file {path}; {fix}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: {path} is not JSON ({e.msg}, line {e.lineno}); {fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: cannot read {path} ({getattr(e, 'strerror', None) or e}); {fix}") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{flag}: {path} holds no list of rows; {fix}")
    return data


def grid_summary(folder: str, flag: str) -> dict[str, Any]:
    """The ``summary.json`` that ``rolecall grid`` (``benchmarks/quality.py``) wrote into ``folder``
    (:func:`read_report`)."""
    return read_report(Path(folder) / "summary.json", flag,
                       "give a folder that benchmarks/quality.py wrote (its --out), or run it into this one first")


def host_cpu() -> str:
    """The host's CPU model (``/proc/cpuinfo``'s model name, else ``platform.processor()``: an Arm host's cpuinfo
    names none): what bounds a pass whose kernels are launched one by one (a short prompt's eager prefill), so a
    figure of one can be read beside its host."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor()


def write_report(out: Path, stem: str, data: dict[str, Any], table: str) -> None:
    """``out/<stem>.json`` (``data``) and ``out/<STEM>.md`` (``table``), atomically; the table printed, then the
    files written (with ``<stem>.png``, which the script drew before)."""
    atomic.write_text(out / f"{stem}.json", json.dumps(data, indent=1))
    atomic.write_text(out / f"{stem.upper()}.md", table)
    print(table, end="")
    print(f"wrote {out / f'{stem}.png'}, {stem}.json, {stem.upper()}.md")
