"""What the summarising scripts share: the rows they can pair, and what they write last (their JSON, their table
as Markdown, the table printed, their figures)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime import atomic


def pairable_scores(row: dict[str, Any] | None) -> list[float] | None:
    """A grid row's per-prompt scores when every prompt has one (what a paired comparison needs), else None."""
    scores = (row or {}).get("scores")
    return scores if scores and None not in scores else None


def write_report(out: Path, stem: str, data: dict[str, Any], table: str) -> None:
    """``out/<stem>.json`` (``data``) and ``out/<STEM>.md`` (``table``), atomically; the table printed, then the
    files written (with ``<stem>.png``, which the script drew before)."""
    atomic.write_text(out / f"{stem}.json", json.dumps(data, indent=1))
    atomic.write_text(out / f"{stem.upper()}.md", table)
    print(table, end="")
    print(f"wrote {out / f'{stem}.png'}, {stem}.json, {stem.upper()}.md")


def save_figure(fig: Any, path: Path) -> None:
    """A matplotlib figure laid out and written to ``path`` atomically (PNG, 120 dpi), then closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic.atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
