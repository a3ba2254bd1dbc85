"""The training loop: HardKuma gates per (layer ≥ 1, KV head), Lagrangian distillation, checkpoints, manifest.

    min over gate parameters, max over λ ≥ 0 of   L = L_distill + λ (E[‖z‖₀] − target)

Gates take Adam steps (lr ``config.lr``) on L; λ takes a gradient-ascent step of ``config.lambda_lr`` on
E[‖z‖₀] − target and is clipped at 0, so it grows while too many heads are retrieval heads and decays once
the constraint holds. The model is frozen (its ``requires_grad`` flags are restored afterwards) and stays
where it is: the caller places it (the CLI does, through accelerate).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from runtime.atomic import write_text
from runtime.manifest import RoleManifest, config_sha256
from train import checkpoint as ckpt
from train.config import TrainConfig, config_json
from train.distill import NotFiniteError, distill_loss
from train.gates import GateParameters
from train.hybrid import HybridAttention, fast_float32_matmul
from train.outputs import UNDECIDED, build_manifest, dataset_provenance, plot_curves, plot_gates

# config fields that may differ between a checkpoint and the run resuming from it
# (the model may move to another path or name: its architecture hash is checked instead)
_RESUMABLE_CHANGES = {"steps", "checkpoint_every", "output", "plots", "device_map", "dtype", "model", "model_name"}


@contextlib.contextmanager
def frozen(model: torch.nn.Module):
    """Turn off gradients for every model parameter; restore each flag on exit."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield model
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def sample_index(step: int, n: int, seed: int) -> int:
    """The data position of ``step``: a fresh permutation of the n samples each epoch, fixed by seed."""
    epoch, offset = divmod(step, n)
    return int(np.random.default_rng([seed, epoch]).permutation(n)[offset])


def _shape(model) -> tuple[int, int]:
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(text.num_hidden_layers), int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)


def _check_finite(step: int, named: dict[str, torch.Tensor]) -> None:
    for name, t in named.items():
        if t is not None and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise NotFiniteError(f"step {step}: {name} holds {bad} non-finite value(s) of {t.numel()}; training "
                                 "stopped. Resume from the last checkpoint with a lower --lr/--lambda-lr, or use "
                                 "--mixed-precision no")


def _accelerator(config: TrainConfig, device: torch.device):
    from accelerate import Accelerator

    kwargs: dict[str, Any] = {"mixed_precision": config.mixed_precision, "cpu": device.type == "cpu"}
    return Accelerator(**kwargs)


def _restore(state: dict[str, Any], config: TrainConfig, model, data: dict[str, Any], gates, optimizer,
             generator) -> None:
    saved = state["config"]
    if state.get("data_sha256") and state["data_sha256"] != data["sha256"]:
        raise ckpt.CheckpointError("cannot resume: the dataset differs from the checkpoint's (sha256 "
                                   f"{state['data_sha256'][:12]}… vs {data['sha256'][:12]}…); use the same data settings")
    if state.get("model_sha256") and state["model_sha256"] != config_sha256(model):
        raise ckpt.CheckpointError("cannot resume: the checkpoint was made for another model architecture "
                                   f"({saved.get('model')!r}); pass the same --model")
    for key, value in config.to_dict().items():
        if key not in _RESUMABLE_CHANGES and saved.get(key) != value:
            raise ckpt.CheckpointError(f"cannot resume: {key} is {saved.get(key)!r} in the checkpoint but {value!r} "
                                       "now; use the checkpoint's settings or start a new run")
    gates.load_state_dict(state["gates"])
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["gate_rng"])
    torch.set_rng_state(state["torch_rng"])
    if torch.cuda.is_available() and state.get("cuda_rng"):
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def run(model, tokenizer, dataset, config: TrainConfig, resume: str | Path | None = None,
        data_info: dict[str, Any] | None = None) -> RoleManifest:
    """Learn head roles of ``model`` on ``dataset`` (items with 1-D ``input_ids`` and ``labels``).

    Writes the manifest to ``config.resolved_output()`` and, next to it, ``.config.json``, ``.log.jsonl``,
    ``.gates.png``, ``.curves.png`` and checkpoints under ``.ckpt/``. ``resume``: a checkpoint path, or
    ``"latest"`` for the newest one of this output. Returns the manifest.
    """
    if len(dataset) == 0:
        raise ValueError("the dataset is empty; build it with at least one sample")
    output = config.resolved_output()
    stem = output.with_name(output.name.removesuffix(".safetensors"))
    log_path = stem.with_name(stem.name + ".log.jsonl")
    device = next(model.parameters()).device
    num_layers, num_kv = _shape(model)
    if num_layers < 2:
        raise ValueError("the model has one layer; head roles need at least two (layer 0 is always retrieval)")
    if config.target > (num_layers - 1) * num_kv:
        raise ValueError(f"target {config.target} exceeds the {(num_layers - 1) * num_kv} gated heads of this model")
    data = dataset_provenance(dataset, data_info)
    accelerator = _accelerator(config, device)
    torch.manual_seed(config.seed)
    gates = GateParameters(config.gate, (num_layers - 1, num_kv), config.low, config.high).to(device)
    optimizer = torch.optim.Adam(gates.parameters(), lr=config.lr)
    gates, optimizer = accelerator.prepare(gates, optimizer)
    generator = torch.Generator().manual_seed(config.seed)  # gate noise on the CPU: same draws on any device
    hybrid = HybridAttention(num_layers, config.token_budget, checkpoint=config.gradient_checkpointing)
    unwrapped = accelerator.unwrap_model(gates)

    start, lam, created, records = 0, 0.0, _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), []
    if resume is not None:
        path = ckpt.latest_checkpoint(output) if str(resume) == "latest" else Path(resume)
        state = ckpt.load_checkpoint(path)
        _restore(state, config, model, data, unwrapped, optimizer, generator)
        start, lam, created = state["step"], state["lambda"], state["created"]
        records = [r for r in ckpt.read_log(log_path) if r["step"] < start]
    write_text(stem.with_name(stem.name + ".config.json"), config_json(config))

    last_loss = math.nan
    with frozen(model), fast_float32_matmul(config.tf32), tqdm(total=config.steps, initial=start, desc="train-heads",
                                                                 dynamic_ncols=True) as bar:
        for step in range(start, config.steps):
            item = dataset[sample_index(step, len(dataset), config.seed)]
            ids, labels = torch.as_tensor(item["input_ids"]), torch.as_tensor(item["labels"])
            dist = unwrapped.distribution()
            z = dist.rsample(generator=generator)  # [L − 1, Hkv]
            with accelerator.autocast():
                loss_d, seen = distill_loss(model, hybrid, z, ids, labels, config.prefill_chunk)
            l0 = dist.expected_l0()
            loss = loss_d + lam * (l0 - config.target)
            try:
                _check_finite(step, {"gates z": z, **seen, "expected L0": l0, "loss": loss})
                optimizer.zero_grad(set_to_none=True)
                accelerator.backward(loss)
                _check_finite(step, {f"gradient of {n}": p.grad for n, p in unwrapped.named_parameters()})
            except NotFiniteError:
                ckpt.write_log(log_path, records)  # keep the history that led here
                raise
            optimizer.step()
            unwrapped.clamp_()
            l0_value = float(l0.detach())
            lam = max(0.0, lam + config.lambda_lr * (l0_value - config.target))
            last_loss = float(loss_d.detach())
            with torch.no_grad():
                ez = unwrapped.distribution().expected_gate().float().cpu()
            records.append({"step": step, "distill_loss": last_loss, "expected_l0": l0_value, "lambda": lam,
                            "sample": sample_index(step, len(dataset), config.seed),
                            "expected_gate": [round(x, 6) for x in ez.flatten().tolist()]})
            bar.set_postfix(loss=f"{last_loss:.4g}", EL0=f"{l0_value:.2f}", lam=f"{lam:.3g}")
            bar.update()
            if (step + 1) % config.checkpoint_every == 0 and step + 1 < config.steps:
                _save(output, step + 1, config, model, data, unwrapped, optimizer, generator, lam, created)
                ckpt.write_log(log_path, records)

    if records and start >= config.steps:  # resumed at the last step: nothing left to train
        last_loss = records[-1]["distill_loss"]
    with torch.no_grad():
        final = unwrapped.distribution()
        ez = final.expected_gate().float().cpu()
        metrics = {
            "steps": config.steps,
            "final_loss": last_loss,
            "final_loss_mean_last_10pct": float(np.mean([r["distill_loss"] for r in records[-max(1, len(records) // 10):]])),
            "expected_l0": float(final.expected_l0()),
            "lambda": lam,
            "fraction_undecided": float(((ez > UNDECIDED[0]) & (ez < UNDECIDED[1])).float().mean()),
            "gate": config.gate,
        }
        manifest = build_manifest(model, final, config, metrics, data, created)
    manifest.metrics["retrieval_heads"] = int(manifest.head_role[1:].sum())
    manifest.save(output)
    ckpt.write_log(log_path, records)
    if config.plots and records:
        plot_gates(records, (num_layers, num_kv), stem.with_name(stem.name + ".gates.png"))
        plot_curves(records, config.target, stem.with_name(stem.name + ".curves.png"))
    return manifest


def _save(output, step, config, model, data, gates, optimizer, generator, lam, created) -> Path:
    state = {
        "format": "rolecall.train-heads",
        "step": step,
        "data_position": step,
        "config": config.to_dict(),
        "model_sha256": config_sha256(model),
        "data_sha256": data["sha256"],
        "gates": gates.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lambda": lam,
        "gate_rng": generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "created": created,
    }
    return ckpt.save_checkpoint(ckpt.checkpoint_path(output, step), state)
