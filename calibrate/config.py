"""The calibration config: dataclass defaults, then a YAML file, then CLI flags (later layers win).

Defaults are DELTA's (page 16, K = 64 pages, L = 8 recent pages, warm-up layers 0–1, three Δ-layers) with a
trace budget that fits a CPU run of the embedded model; ``configs/calibrate/<model>.yaml`` carries the
settings for a named model and is picked up on its own when ``--config`` is not given.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolecall.core.configfile import ConfigError, layered, read_config, shipped


@dataclass
class CalibrateConfig:
    # what to calibrate
    model: str = "smollm2-135m"
    dtype: str | None = None  # torch dtype name; None = the model alias's dtype
    device: str | None = None  # "cpu", "cuda", "cuda:1"; None = cuda when available
    device_map: str | None = None  # "auto" shards a model larger than one GPU
    deepspeed: str | None = None  # a DeepSpeed JSON (path or configs/deepspeed/ name) whose ZeRO-3 shards the model
    random_weights: bool = False  # the model's architecture with random weights: speed and memory only
    # traces
    prompts: str = "champ"  # rolecall.data.reasoning source: champ, arithmetic[:N], jsonl:PATH
    num_prompts: int = 8
    max_new_tokens: int = 320
    sample: bool = False  # greedy by default; sampling uses temperature / top_p with `seed`
    temperature: float = 0.6
    top_p: float = 0.95
    seed: int = 0
    traces: str | None = None  # a JSONL file of {"text"} or {"ids"}: skips generation
    max_traces: int | None = None  # use at most this many traces
    # recording
    stride: int = 16  # record every stride-th query position ...
    min_context: int = 128  # ... from this position on
    chunk_size: int = 4096  # prefill chunk (tokens per forward)
    query_block: int = 16  # sampled rows whose probabilities are materialised at once
    bins: int = 8  # decode-time bins of the sparsity profile
    # DELTA
    page_size: int = 16
    num_pages: int = 64  # K: pages a sparse layer reads in all, the L recent ones included (the delta policy's too)
    recent_pages: int = 8  # L
    warmup: int = 2  # layers [0, warmup) are full; layer `warmup` is the first Δ-layer
    num_delta: int | str = 3  # Δ-layers including layer `warmup`, or "auto" (smallest set reaching target_recall)
    select: str = "peaks"  # "peaks" (shift peaks, as DELTA) or "recall" (greedy on simulated recall)
    min_gap: int = 3  # minimum distance in layers between two shift peaks
    target_recall: float = 0.9
    # Lethe
    budget: float = 0.25  # mean fraction of the context a layer keeps
    min_budget: float = 0.02
    # hybrid models: sliding-window layers keep their own attention, so they are neither recorded, Δ-layers nor
    # given Lethe budgets; True records them and lets them be chosen like any other layer
    include_sliding: bool = False
    # outputs
    output: str | None = None  # default artifacts/<model>.delta.safetensors
    plots: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes carried into the manifest config

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"calibration config: {what}")

        for name in ("num_prompts", "max_new_tokens", "stride", "chunk_size", "query_block", "bins", "page_size",
                     "recent_pages"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, f"{name} must be an integer ≥ 1, "
                 f"got {getattr(self, name)!r}")
        for name in ("min_context", "num_pages", "warmup", "seed"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 0,
                 f"{name} must be an integer ≥ 0, got {getattr(self, name)!r}")
        need(self.min_gap >= 1, f"min_gap must be ≥ 1, got {self.min_gap}")
        need(self.num_pages >= self.recent_pages, f"num_pages (K, {self.num_pages}) counts the recent pages "
             f"(L, {self.recent_pages}) too, so it must be ≥ recent_pages")
        if isinstance(self.num_delta, str) and self.num_delta.isdigit():
            self.num_delta = int(self.num_delta)
        need(self.num_delta == "auto" or (isinstance(self.num_delta, int) and self.num_delta >= 1),
             f"num_delta must be an integer ≥ 1 or 'auto', got {self.num_delta!r}")
        from rolecall.calibrate.delta import SELECTORS
        from rolecall.core.models import DTYPES

        need(self.select in SELECTORS, f"select must be one of {sorted(SELECTORS)}, got {self.select!r}")
        need(self.dtype is None or self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        need(0.0 < self.target_recall <= 1.0, f"target_recall must be in (0, 1], got {self.target_recall}")
        need(0.0 < self.budget <= 1.0, f"budget must be a fraction in (0, 1], got {self.budget}")
        need(0.0 <= self.min_budget <= self.budget, f"min_budget must be in [0, budget], got {self.min_budget}")
        need(isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0
             and 0 < self.top_p <= 1, f"temperature must be a finite number > 0 and top_p in (0, 1], got "
             f"{self.temperature!r} and {self.top_p!r}")
        need(self.max_traces is None or self.max_traces >= 1, f"max_traces must be ≥ 1, got {self.max_traces}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> CalibrateConfig:
        return resolve(self.to_dict(), changes)


# the key the shipped manifests written before its rename carry in their settings, read under its current name
RENAMED = {"top_pages": "num_pages"}


def resolve(*layers: dict[str, Any] | None) -> CalibrateConfig:
    """Merge ``layers`` over the dataclass defaults, later ones winning (:func:`rolecall.core.configfile.layered`).
    A key of an older release (``RENAMED``) is read as its current name."""
    current = [{RENAMED.get(k, k): v for k, v in layer.items()} if layer else layer for layer in layers]
    return layered(CalibrateConfig, *current, what="calibration config")


def read_yaml(name_or_path: str | Path) -> dict[str, Any]:
    """A calibration config file, or the name of one in ``configs/calibrate/``."""
    return read_config(name_or_path, "calibration config", "calibrate")


def shipped_config(model: str) -> Path | None:
    """``configs/calibrate/<model>.yaml`` when it ships with the package."""
    return shipped("calibrate").get(model)


def dumps(config: CalibrateConfig) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, indent=2) + "\n"
