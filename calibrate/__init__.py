"""Calibration: record attention on traces, choose DELTA's Δ-layers and Lethe's per-layer budgets."""

from calibrate.api import run, save
from calibrate.config import CalibrateConfig

__all__ = ["CalibrateConfig", "run", "save"]
