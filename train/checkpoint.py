"""Checkpoints and the training log, written atomically (temporary file in the same folder, then rename).

A checkpoint holds what the next step depends on: the step, gate parameters, optimizer state, λ, the gate
sampler's RNG and torch's global RNG states, so that resuming from step N gives the same manifest as never
stopping. The data position is the step itself (the sample order is a function of seed and epoch), stored too
so a reader can see it.

A run owns its checkpoint folder: every checkpoint carries the run's id (``train.recipe.run_id``: a hash of the
settings that decide the numbers, the data's hash and the model's architecture, never the time), a resume
accepts only a checkpoint of the same run, and a fresh run does not start over another run's checkpoints or
manifest unless told to (``--overwrite``, which removes the old checkpoints first). The log of the steps so far
lives in the checkpoint folder (``log.jsonl``) until the run succeeds; only then is ``<stem>.log.jsonl`` written
beside the manifest.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from runtime.atomic import atomic_write, write_text


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or belongs to another run."""


def checkpoint_dir(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".safetensors") + ".ckpt")


def progress_log(folder: Path) -> Path:
    """The log of the steps so far, kept beside the checkpoints of ``folder`` while the run goes on."""
    return Path(folder) / "log.jsonl"


def claim_output(output: Path, overwrite: bool = False) -> None:
    """Before a fresh run: refuse an output whose manifest or checkpoint folder exists, or, with ``overwrite``,
    remove that checkpoint folder (the old manifest and its sidecars stay until the new ones replace them)."""
    output, folder = Path(output), checkpoint_dir(Path(output))
    taken = [what for what, p in (("its manifest", output), (f"checkpoints in {folder}", folder)) if p.exists()]
    if not taken:
        return
    if not overwrite:
        raise CheckpointError(f"output {output} is taken ({' and '.join(taken)} from an earlier run); pass "
                              "--overwrite to replace it (old checkpoints are removed first), --resume to continue "
                              "that run, or a new --output")
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
    return checkpoint_dir(output) / f"step-{step:07d}.pt"


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
