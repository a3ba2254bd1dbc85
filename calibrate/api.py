"""``calibrate.run``: traces in, role manifest out. The CLI (``rolecall.calibrate.cli``) only wraps this.

Hybrid models (Gemma 3 and others whose ``layer_types`` mix sliding-window and full attention): the sliding
layers keep their own windowed attention at decode time, so by default they are not recorded, never become
Δ-layers and get no Lethe budget (their window is their budget; the manifest stores 1.0 for them). The shift
curve is then the cosine shift between consecutive *full-attention* layers: DELTA's signal is how much the
token ranking changes between two layers that could share a selection, and a sliding layer in between
neither selects nor reads, while its windowed ``a`` would compare a window against a whole prefix.
``include_sliding=True`` records and treats every layer alike.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rolecall.calibrate.config import CalibrateConfig, dumps, resolve
from rolecall.calibrate.delta import (
    candidate_recall,
    get_selector,
    layer_roles,
    mean_sparse_recall,
    recall_per_layer,
    select_among,
)
from rolecall.calibrate.lethe import LetheBudget
from rolecall.calibrate.recorder import AttentionRecorder, record_traces
from rolecall.calibrate.totals import CalibrationTotals
from rolecall.calibrate.traces import traces_sha256
from rolecall.core import distributed
from rolecall.core.atomic import write_text
from rolecall.core.manifest import ModelIdentity, RoleManifest, portable_name
from rolecall.core.models import sliding_layers

_SIDECAR = "_calibrate_config"  # attribute of a manifest from decide(): its config with the paths as given


def _text_config(model):
    """The text config of ``model``, or of ``model`` itself when it is a config (:func:`rolecall.core.models.load_config`)."""
    cfg = getattr(model, "config", model)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _shard(traces: list[list[int]]) -> list[list[int]]:
    """This process's share of the traces under ``torch.distributed`` (round robin), else all of them."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return traces[dist.get_rank() :: dist.get_world_size()]
    return traces


def model_name(model) -> str:
    spec = getattr(model, "rolecall_spec", None)
    return spec.name if spec is not None else str(getattr(model.config, "_name_or_path", "") or "model")


def excluded_layers(model, config: CalibrateConfig) -> list[int]:
    """Layers that are not candidates: the sliding-window ones, unless ``include_sliding``."""
    return [] if config.include_sliding else sliding_layers(model)


def candidate_layers(model, config: CalibrateConfig) -> list[int]:
    num_layers = int(_text_config(model).num_hidden_layers)
    skip = set(excluded_layers(model, config))
    candidates = [i for i in range(num_layers) if i not in skip]
    if not candidates:
        raise ValueError("every layer of this model uses a sliding window, so none needs a role; pass "
                         "--include-sliding (include_sliding=True) to calibrate them anyway")
    return candidates


def check_layers(model, config: CalibrateConfig) -> int:
    """Refuse, in one line, a ``warmup`` or a ``num_delta`` the model has no room for. ``model`` may be its config
    alone (:func:`rolecall.core.models.load_config`), so this runs before any weights load. Returns the number of layers
    there are to select Δ-layers from: the candidates from layer ``warmup`` on."""
    candidates = candidate_layers(model, config)
    num_layers = int(_text_config(model).num_hidden_layers)
    selectable = sum(1 for layer in candidates if layer >= config.warmup)
    if not selectable:
        raise ValueError(f"--warmup {config.warmup} leaves no layer to select Δ-layers from in a {num_layers}-layer "
                         f"model; pass --warmup W with 0 <= W <= {candidates[-1]}")
    if config.num_delta != "auto" and config.num_delta > selectable:
        skipped = sum(1 for layer in excluded_layers(model, config) if layer >= config.warmup)
        less = [f"{count} {kind}" for count, kind in ((config.warmup, "warm-up"), (skipped, "sliding-window")) if count]
        raise ValueError(f"--num-delta {config.num_delta} is more than the {selectable} layers to select from "
                         f"({num_layers} layers{' less ' + ' and '.join(less) if less else ''}); pass --num-delta N "
                         f"with 1 <= N <= {selectable}, or --num-delta auto")
    return selectable


def record(model, traces: list[list[int]], config: CalibrateConfig, progress: bool = True) -> CalibrationTotals:
    """Record this process's share of ``traces`` and sum the totals over all processes."""
    text = _text_config(model)
    recorder = AttentionRecorder(
        text.num_hidden_layers, text.num_attention_heads, stride=config.stride, min_context=config.min_context,
        page_size=config.page_size, num_pages=config.num_pages, recent_pages=config.recent_pages,
        bins=config.bins, query_block=config.query_block, layers=candidate_layers(model, config),
        full_keys=bool(config.include_sliding and sliding_layers(model)))
    mine = _shard(traces)
    totals = record_traces(model, mine, recorder, chunk_size=config.chunk_size, progress=progress)
    if distributed.is_sharded(model) and distributed.world_size() > 1:  # ZeRO-3: as many forwards as the busiest
        forwards = sum(-(-len(ids) // config.chunk_size) for ids in mine)
        most = int(distributed.per_process([forwards]).max())
        distributed.pad_forwards(model, torch.tensor([traces[0][:1]], device=distributed.model_device(model)),
                                 most - forwards)
    return totals.all_reduce().to("cpu")


def decide(model, totals: CalibrationTotals, config: CalibrateConfig, data: dict[str, Any]) -> RoleManifest:
    """Δ-layers, Lethe budgets and metrics from recorded totals → the manifest."""
    if totals.recall_count.item() == 0:
        longest = int(data.get("longest", 0))
        raise ValueError(f"no query was sampled: the longest trace has {longest} tokens but recording starts at "
                         f"min_context={config.min_context}; lower --min-context or use longer traces")
    m = totals.means()
    num_layers = totals.num_layers
    check_layers(model, config)
    kw = {"warmup": config.warmup, "min_gap": config.min_gap, "target_recall": config.target_recall}
    sliding = excluded_layers(model, config)
    candidates = candidate_layers(model, config)
    delta = select_among(get_selector(config.select, **kw), m["shift"], m["recall"], config.num_delta, candidates)
    peaks = select_among(get_selector("peaks", **kw), m["shift"], m["recall"], len(delta), candidates)
    # recall and budgets over the candidates; excluded (sliding) layers compute what the model computes: 1.0
    recall_c, index = candidate_recall(m["recall"], candidates), {layer: i for i, layer in enumerate(candidates)}
    warmup_c = sum(1 for layer in candidates if layer < config.warmup)

    def sparse_recall(chosen: list[int]) -> float:
        return mean_sparse_recall(recall_c, [index[d] for d in chosen], warmup_c)

    per_layer = torch.ones(num_layers, dtype=m["recall"].dtype)
    per_layer[candidates] = recall_per_layer(recall_c, [index[d] for d in delta], warmup_c)
    budget = torch.ones(num_layers, dtype=torch.float32)
    budget[candidates] = LetheBudget(config.budget, config.min_budget)(m["sparsity"][candidates])

    def r(x: torch.Tensor) -> list:
        return [round(float(v), 6) for v in x.flatten()] if x.dim() <= 1 else [r(row) for row in x]

    metrics = {
        "delta_layers": delta,
        "select": config.select,
        "recall_mean": round(sparse_recall(delta), 6),
        "recall_per_layer": r(per_layer),
        "peaks_delta_layers": peaks,
        "peaks_recall_mean": round(sparse_recall(peaks), 6),
        "recall_pairs": r(m["recall"]),  # [s][l]: lets another Δ set be scored without re-running the model
        "drift": r(m["drift"]),
        "head_sparsity": r(m["head_sparsity"]),
        "bin_positions": r(m["positions"]),
        "budget_tokens": config.num_pages * config.page_size,  # K pages in all, the L recent ones among them
        "sampled_queries": int(totals.recall_count.item()),
    }
    if sliding:
        metrics["sliding_layers"] = sliding
    # where the manifest is written is not part of what it says: leave it out, and name input files by their file
    # name alone (their content hash is data.sha256), so reruns anywhere are byte-identical
    recorded = {k: v for k, v in config.to_dict().items() if k != "output"}
    recorded.update({k: portable_name(recorded[k]) for k in ("traces", "prompts", "model") if recorded.get(k)})
    manifest = RoleManifest(
        model=ModelIdentity.from_config(model.config, name=portable_name(model_name(model))),
        layer_role=layer_roles(num_layers, delta, config.warmup, sliding),
        layer_shift=m["shift"], layer_sparsity=m["sparsity"], layer_budget=budget,
        config=recorded, data=data, metrics=metrics,
    )
    setattr(manifest, _SIDECAR, config.to_dict())  # the sidecar config keeps the paths, to re-run from it
    return manifest


def run(model, tokenizer, traces, config: CalibrateConfig | dict[str, Any] | None = None, *,
        data: dict[str, Any] | None = None, progress: bool = True,
        times: dict[str, float] | None = None) -> RoleManifest:
    """Record attention on ``traces`` and decide DELTA's layer roles and Lethe's budgets; ``times``, when given,
    receives the seconds of ``recording`` and ``selection``.

    ``traces``: token-id lists or texts (texts are tokenised without special tokens). ``config``: a
    :class:`CalibrateConfig` or a dict of its fields. ``data``: provenance to merge into the manifest's ``data``
    (the trace count, token count and hash are always recorded). Under ``torch.distributed`` each process
    records a round-robin share and the sums are reduced, so every process returns the same manifest.
    """
    if not isinstance(config, CalibrateConfig):
        config = resolve(config or {})
    traces = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) if isinstance(t, str) else list(t)
              for t in traces]
    if config.max_traces is not None:
        traces = traces[: config.max_traces]
    if not traces:
        raise ValueError("no calibration traces; pass prompts to generate from or a --traces file")
    provenance = {"traces": len(traces), "tokens": sum(map(len, traces)), "longest": max(map(len, traces)),
                  "sha256": traces_sha256(traces), **(data or {})}
    if isinstance(provenance.get("source"), str):  # e.g. file:/home/me/t.jsonl -> file:t.jsonl
        provenance["source"] = portable_name(provenance["source"])
    check_layers(model, config)  # before recording, which takes long
    began = time.perf_counter()
    totals = record(model, traces, config, progress=progress)
    recorded = time.perf_counter()
    manifest = decide(model, totals, config, provenance)
    if times is not None:
        times.update(recording=recorded - began, selection=time.perf_counter() - recorded)
    return manifest


def save(manifest: RoleManifest, output: str | os.PathLike, plots: bool = True) -> list[Path]:
    """Write the resolved config (``<stem>.config.json``) and, with ``plots``, the PNGs beside ``output``, each
    atomically, and then the manifest by its atomic rename: a kill at any point leaves the earlier manifest (with
    some new sidecars) or the new one with all of its own, never a new manifest beside an earlier config. The plots
    are drawn into a hidden folder first, so a plot that fails leaves every earlier file as it was. The config file
    holds the paths as they were given (the manifest only their file names). Returns the paths, manifest first."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    stem = output.name.removesuffix(".safetensors")
    config_path = output.with_name(f"{stem}.config.json")
    given = {**manifest.config, **getattr(manifest, _SIDECAR, {})}
    config_text = dumps(resolve(given, {"output": str(output)}))
    with tempfile.TemporaryDirectory(prefix=f".{stem}.plots.", dir=output.parent) as drawn:
        pngs = []
        if plots:
            from rolecall.calibrate.plots import plot_all

            pngs = plot_all(manifest, drawn, stem)
        write_text(config_path, config_text)
        placed = [output.with_name(png.name) for png in pngs]
        for png, path in zip(pngs, placed):  # each written atomically in the same folder: a rename places it
            os.replace(png, path)
    return [manifest.save(output), config_path, *placed]
