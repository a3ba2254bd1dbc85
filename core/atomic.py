"""Atomic file writes: a temporary file in the target's folder, flushed to disk, then renamed over the target.

A crash or an exception leaves either the old file or the new one, never half of one, and no temporary file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

FILE_MODE = 0o644  # mkstemp creates owner-only files; outputs are meant to be shared


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds, rename it over ``path``.

    For writers that want a file name (``savefig``, ``save_pretrained`` of a single file); ``suffix`` keeps the
    extension they infer the format from.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Call ``write(file)`` on a binary temporary file, fsync it, and rename it over ``path``."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    return Path(path)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_figure(fig, path: str | os.PathLike, dpi: int = 120, **savefig) -> Path:
    """A matplotlib figure written to ``path`` as a PNG of at most 256 colours, atomically, then closed (also when
    the write fails).

    A plot's flat colours and anti-aliased edges fit a 256-colour palette with no visible change at a third of an
    RGBA file's bytes; the file holds no metadata (no software version, no date), so the same figure gives the
    same bytes. ``savefig`` goes to ``Figure.savefig`` (``bbox_inches``, for one).
    """
    import io

    import matplotlib.pyplot as plt
    from PIL import Image

    try:
        rendered = io.BytesIO()
        fig.savefig(rendered, format="png", dpi=dpi, **savefig)
        rendered.seek(0)
        image = Image.open(rendered).convert("RGB")
        palette = image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        packed = io.BytesIO()
        palette.save(packed, format="PNG", optimize=True)
    finally:
        plt.close(fig)
    return write_bytes(path, packed.getvalue())


def check_writable(path: str | os.PathLike, flag: str, folder: bool = False) -> None:
    """Refuse, before any work, an output ``path`` that cannot be written: its folder is made (as the write would
    make it) and a temporary file opened in it and removed. One line naming the flag, the path, why and the fix.
    With ``folder``, ``path`` is a folder the files are written into, not a file; a missing one is not made here
    (a refused run leaves nothing behind): the nearest folder above it must take a file."""
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: a file is there; give the path of a folder")
    if not folder and path.is_dir():
        raise ValueError(f"{flag} {path}: a folder is there; give the path of a file")
    above = next((p for p in path.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ValueError(f"{flag} {path}: {above} is a file, not a folder; give a path you can write")
    where = (path if path.exists() else above) if folder else path.parent
    try:
        if not folder:
            where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror or e}); give a path you can write") from None
