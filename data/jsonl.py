"""Reading JSON Lines files the same way everywhere: blank lines skipped, a bad line named by number."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any


def iter_jsonl(path: str | os.PathLike, error: type[Exception], example: str) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed value)`` for every non-blank line of ``path``.

    A line that is not JSON raises ``error`` with the file, the line number and ``example`` (the expected form,
    e.g. ``{"prompt": ...}``), so the user knows what to fix.
    """
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                raise error(f"{path}: line {number} is not JSON; write one {example} object per line") from None
            yield number, value
