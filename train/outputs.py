"""What a training run leaves behind: the role manifest, and plots drawn from the training log."""

from __future__ import annotations

import hashlib
from itertools import repeat
from pathlib import Path
from typing import Any

import torch

from rolecall.core.atomic import write_figure
from rolecall.core.manifest import ModelIdentity, RoleManifest, portable_name

UNDECIDED = (0.05, 0.95)  # a gate whose E[z] lies strictly inside is neither retrieval nor sparse yet


def head_roles(expected: torch.Tensor, target: int, exact: bool, held: torch.Tensor | None = None) -> torch.Tensor:
    """Roles of the gated heads [L − 1, Hkv] from E[z]: E[z] > 0.5, or exactly the top-``target`` by E[z].

    ``held`` (bool, same shape): gates held open, which never take one of the ``target`` places.
    """
    if not exact:
        return (expected > 0.5).to(torch.int8)
    flat = torch.zeros(expected.numel(), dtype=torch.int8)
    ranked = expected.double() if held is None else expected.double().masked_fill(held, -1.0)
    # stable order: ties go to the earlier (layer, head)
    order = torch.argsort(-ranked.flatten(), stable=True)[: min(target, int((ranked >= 0).sum()))]
    flat[order] = 1
    return flat.view_as(expected)


def portable_config(config: dict[str, Any]) -> dict[str, Any]:
    """A config dict as the manifest records it: the output, a JSONL dataset and a local passkey corpus by file
    name (the data's content hash is in ``data.sha256``)."""
    out = dict(config)
    if out.get("output"):
        out["output"] = Path(out["output"]).name
    if out.get("dataset") and out["dataset"] != "passkey":
        out["dataset"] = Path(out["dataset"]).name
    if out.get("data_source"):
        out["data_source"] = portable_name(out["data_source"])
    if out.get("model"):  # a local model folder by its name (aliases and hub ids stay as they are)
        out["model"] = portable_name(out["model"])
    return out


def build_manifest(model, gates_dist, config, metrics: dict[str, Any], data: dict[str, Any]) -> RoleManifest:
    """Layer 0 is not gated: it is all retrieval, with E[z] = 1 and the initial α = β = 1 recorded.

    Hybrid models: sliding-window layers (held open, E[z] = 1) are not retrieval heads (role 0; the runtime
    runs their own attention whatever the role), and the first full-attention layer is all retrieval, as layer
    0 is otherwise. ``metrics["retrieval_heads"]`` counts the learned retrieval heads.
    """
    from rolecall.train.hybrid import GateLayout

    expected = gates_dist.expected_gate().detach().float().cpu()  # [L − 1, Hkv]
    alpha, beta = (t.detach().float().cpu() for t in gates_dist.manifest_params())
    hkv = expected.shape[1]
    ones = torch.ones(1, hkv)
    spec = getattr(model, "rolecall_spec", None)
    name = portable_name(config.model_name or getattr(spec, "name", None) or config.model)
    layout = GateLayout.of(model, getattr(config, "include_sliding", False))
    held = layout.fixed_open(hkv)
    role = torch.cat([ones.to(torch.int8), head_roles(expected, config.target, config.exact_target, held)])
    role[list(layout.sliding)] = 0
    role[layout.first_full] = 1
    learned = [i for i in range(1, layout.num_layers) if i not in set(layout.held)]
    metrics = {**metrics, "retrieval_heads": int(role[learned].sum())}
    if layout.sliding:
        metrics["sliding_layers"] = list(layout.sliding)
    return RoleManifest(
        model=ModelIdentity.from_config(model, name=name),
        head_role=role,
        head_alpha=torch.cat([ones, alpha.expand_as(expected)]),
        head_beta=torch.cat([ones, beta.expand_as(expected)]),
        head_expected_gate=torch.cat([ones, expected]),
        config=portable_config(config.to_dict()), data=data, metrics=metrics,
    )


def dataset_provenance(dataset, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where the data came from plus a sha256 over every sample's input_ids and labels.

    Paths (a JSONL file's ``path``, a local corpus in ``source``) are recorded by file name: the hash says
    what the data was, wherever it lay."""
    h = hashlib.sha256()
    for i in range(len(dataset)):
        item = dataset[i]
        for key in ("input_ids", "labels"):
            h.update(torch.as_tensor(item[key], dtype=torch.int64).numpy().tobytes())
    info = dict(info or {})
    if info.get("path"):
        info["path"] = Path(info["path"]).name
    if isinstance(info.get("source"), str):
        info["source"] = portable_name(info["source"])
    return {**info, "num_samples": len(dataset), "sha256": h.hexdigest()}


def plot_gates(records: list[dict[str, Any]], shape: tuple[int, int], path: Path, panels: int = 6) -> Path:
    """E[z] heatmaps (layer × KV head, layer 0 included as all-retrieval) at evenly spaced steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    picks = sorted({records[round(i * (len(records) - 1) / max(panels - 1, 1))]["step"] for i in range(panels)})
    by_step = {r["step"]: r for r in records}
    fig, axes = plt.subplots(1, len(picks), figsize=(1.2 + 1.1 * len(picks) * max(1, shape[1] / 3), 0.16 * shape[0] + 1.5),
                             squeeze=False, sharey=True)
    for ax, step in zip(axes[0], picks):
        ez = torch.tensor(by_step[step]["expected_gate"]).view(shape[0] - 1, shape[1])
        grid = torch.cat([torch.ones(1, shape[1]), ez]).numpy()
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", interpolation="nearest")
        ax.set_title(f"step {step}", fontsize=9)
        ax.set_xlabel("KV head")
        ax.set_xticks(range(shape[1]))
    axes[0][0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="E[z]")
    write_figure(fig, path, dpi=120)
    return path


def plot_curves(records: list[dict[str, Any]], target: int, path: Path, goal: float | None = None,
                learned: list[bool] | None = None) -> Path:
    """Distillation loss, E[L0] (with the target, and the E[L0] that means the target under the gates' probability
    bound) with the count of learned gates at E[z] > 0.5, and λ over steps.

    ``learned``: per gate (flattened like ``expected_gate``), False for gates held open, which the count leaves
    out as E[L0] and the target do; None counts every gate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    axes[0].plot(steps, [r["distill_loss"] for r in records], lw=0.8)
    axes[0].set_yscale("log")
    axes[0].set_title("distillation loss")
    axes[1].plot(steps, [r["expected_l0"] for r in records], lw=0.8, label="E[L0]")
    axes[1].plot(steps, [sum(x > 0.5 for x, keep in zip(r["expected_gate"], learned or repeat(True)) if keep)
                         for r in records], lw=0.8, label="learned gates with E[z] > 0.5")
    axes[1].axhline(target, color="k", ls="--", lw=0.8, label=f"target {target}")
    if goal is not None and abs(goal - target) > 1e-9:
        axes[1].axhline(goal, color="k", ls=":", lw=0.8, label=f"E[L0] goal {goal:.2f}")
    axes[1].legend()
    axes[1].set_title("expected retrieval heads")
    axes[2].plot(steps, [r["lambda"] for r in records], lw=0.8)
    axes[2].set_title("λ")
    for ax in axes:
        ax.set_xlabel("step")
    fig.tight_layout()
    write_figure(fig, path, dpi=120)
    return path
