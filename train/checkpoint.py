"""Checkpoints and the training log, written atomically (temporary file in the same folder, then rename).

A checkpoint holds what the next step depends on: the step, gate parameters, optimizer state, λ, the gate
sampler's RNG, torch's global RNG states and the run's start time, so that resuming from step N gives the
same manifest as never stopping. The data position is the step itself (the sample order is a function of
seed and epoch), stored too so a reader can see it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from runtime.atomic import atomic_write, write_text


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or belongs to another run."""


def checkpoint_dir(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".safetensors") + ".ckpt")


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
