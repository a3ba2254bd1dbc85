"""What the summarising scripts write last: their JSON, their table as Markdown, the table printed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime import atomic


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
