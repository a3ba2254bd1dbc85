"""Checkpoints and the training log, written atomically (temporary file in the same folder, then rename).

A checkpoint holds what the next step depends on: the step, gate parameters, optimizer state, λ, the gate
sampler's RNG and torch's global RNG states, so that resuming from step N gives the same manifest as never
stopping. The data position is the step itself (the sample order is a function of seed and epoch), stored too
so a reader can see it.

A run owns its checkpoint folder: every checkpoint carries the run's id (``rolecall.train.recipe.run_id``: a hash of the
settings that decide the numbers, the data's hash and the model's architecture, never the time), a resume
accepts only a checkpoint of the same run, and a fresh run does not start over another run's checkpoints or
manifest unless told to (``--overwrite``). Even then the earlier run's folder stays whole until the new run has
something to put in its place: its first checkpoint, which :func:`replace_folder` swaps in by renames, or its
manifest, after which :func:`remove_folder` clears the old one. A run that fails before either leaves the
earlier run's checkpoints and log as they were. The log of the steps so far lives in the checkpoint folder
(``log.jsonl``) until the run succeeds; only then is ``<stem>.log.jsonl`` written beside the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from rolecall.core.atomic import atomic_write, write_text


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or belongs to another run."""


def checkpoint_dir(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".safetensors") + ".ckpt")


def progress_log(folder: Path) -> Path:
    """The log of the steps so far, kept beside the checkpoints of ``folder`` while the run goes on."""
    return Path(folder) / "log.jsonl"


def claim_output(output: Path, overwrite: bool = False) -> bool:
    """Before a fresh run: refuse an output whose manifest or checkpoint folder exists, unless ``overwrite``.
    Nothing is removed here: returns whether an earlier run's checkpoint folder is there for this run to replace
    (:func:`replace_folder` at its first checkpoint, :func:`remove_folder` after its manifest)."""
    output, folder = Path(output), checkpoint_dir(Path(output))
    taken = [what for what, p in (("its manifest", output), (f"checkpoints in {folder}", folder)) if p.exists()]
    if taken and not overwrite:
        raise CheckpointError(f"output {output} is taken ({' and '.join(taken)} from an earlier run); pass "
                              "--overwrite to replace it (when the new run writes its first checkpoint or its "
                              "manifest), --resume to continue that run, or a new --output")
    return folder.exists()


def replace_folder(output: Path, fill: Callable[[Path], object]) -> Path:
    """Put a new checkpoint folder of ``output`` in place of the earlier run's: ``fill(folder)`` writes it under a
    hidden name beside the old one, then two renames swap it in and the old one is deleted. Until the swap the old
    folder is whole (a failure of ``fill`` removes only the new one); a kill between the two renames leaves the old
    one under a hidden name (``.<name>.old.*``) and no folder to resume from."""
    folder = checkpoint_dir(Path(output))
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.new.", dir=folder.parent))
    os.chmod(staging, 0o755)  # mkdtemp makes it owner-only; checkpoints are outputs like any other
    aside = None
    try:
        fill(staging)
        if folder.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
            os.replace(folder, aside / folder.name)
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if aside is not None:
            if not folder.exists():
                os.replace(aside / folder.name, folder)  # the earlier run's, back where it was
            aside.rmdir()
        raise
    if aside is not None:
        shutil.rmtree(aside)
    return folder


def remove_folder(output: Path) -> None:
    """Delete the checkpoint folder of ``output`` (or a file in its place), if any."""
    folder = checkpoint_dir(Path(output))
    if folder.is_dir():
        shutil.rmtree(folder)
    elif folder.exists():
        folder.unlink()


def check_run(state: dict[str, Any], path: Path, run_id: str, reason: str | None = None) -> None:
    """Refuse a checkpoint of another run; ``reason`` says what differs, when the caller knows."""
    saved = state.get("run_id")
    if saved == run_id or (saved is None and reason is None):  # checkpoints without an id: the caller's checks
        return
    why = reason or f"run id {str(saved)[:12]}… there, {run_id[:12]}… now"
    raise CheckpointError(f"checkpoint in {Path(path).parent} belongs to another run ({why}); "
                          "use a new --output or --overwrite")


def checkpoint_path(output: Path, step: int) -> Path:
    return checkpoint_file(checkpoint_dir(output), step)


def checkpoint_file(folder: Path, step: int) -> Path:
    return Path(folder) / f"step-{step:07d}.pt"


def save_checkpoint(path: Path, state: dict[str, Any]) -> Path:
    return atomic_write(path, lambda f: torch.save(state, f))


def latest_checkpoint(output: Path) -> Path:
    found = sorted(checkpoint_dir(output).glob("step-*.pt"))
    if not found:
        raise CheckpointError(f"no checkpoint in {checkpoint_dir(output)}; train without --resume first, "
                              "or pass --resume PATH to a step-*.pt file")
    return found[-1]


def load_checkpoint(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint; pass --resume with a step-*.pt file or without a value")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged file
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__}); delete it and resume "
                              "from an earlier one") from None
    if not isinstance(state, dict) or state.get("format") != "rolecall.train-heads":
        raise CheckpointError(f"{path}: not a train-heads checkpoint")
    return state


def read_log(path: Path) -> list[dict[str, Any]]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_log(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    return write_text(path, text)
