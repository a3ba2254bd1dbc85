"""Calibration: record attention on traces, choose DELTA's Δ-layers and Lethe's per-layer budgets."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolecall.calibrate.api import run, save
    from rolecall.calibrate.config import CalibrateConfig

__all__ = ["CalibrateConfig", "run", "save"]


def __getattr__(name: str):
    # imported on first use, so `import rolecall.calibrate.cli` (and `rolecall --help`) loads no transformers
    if name in ("run", "save"):
        from rolecall.calibrate import api

        return getattr(api, name)
    if name == "CalibrateConfig":
        from rolecall.calibrate.config import CalibrateConfig

        return CalibrateConfig
    raise AttributeError(f"module 'rolecall.calibrate' has no attribute {name!r}")
