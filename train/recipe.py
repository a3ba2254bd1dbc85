"""The training loop: HardKuma gates per (layer ≥ 1, KV head), Lagrangian distillation, checkpoints, manifest.

    min over gate parameters, max over λ ≥ 0 of   L = L_distill + λ (E[‖z‖₀] − target)

Gates take Adam steps (lr ``config.lr``) on L; λ takes a gradient-ascent step of ``config.lambda_lr`` on
E[‖z‖₀] − target and is clipped at 0, so it grows while too many heads are retrieval heads and decays once
the constraint holds. The model is frozen (its ``requires_grad`` flags are restored afterwards) and stays
where it is: the caller places it (the CLI does, see ``rolecall.core.distributed``).

A step reads ``batch_size`` samples (data positions step·B … step·B + B − 1 of a seeded permutation stream)
with one gate draw z. Under ``torch.distributed`` the samples are split round robin over the processes, the
gradients with respect to z are summed over them, and every process then takes the same optimizer and λ
step on its replica of the gates: the run computes the same numbers on any number of processes, and a
checkpoint resumes on a different number.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rolecall.core import distributed
from rolecall.core.atomic import write_text
from rolecall.core.manifest import RoleManifest, config_sha256
from rolecall.train import checkpoint as ckpt
from rolecall.train.config import TrainConfig, config_json
from rolecall.train.distill import NotFiniteError, distill_loss, prefill_calls, split_sample
from rolecall.train.gates import GateParameters
from rolecall.train.hybrid import GateLayout, HybridAttention, fast_float32_matmul
from rolecall.train.outputs import (
    UNDECIDED,
    build_manifest,
    dataset_provenance,
    plot_curves,
    plot_gates,
    portable_config,
)

# config fields that may differ between a checkpoint and the run resuming from it
# (the model may move to another path or name: its architecture hash is checked instead)
_RESUMABLE_CHANGES = {"steps", "checkpoint_every", "output", "plots", "device_map", "dtype", "model", "model_name",
                      "deepspeed"}


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
            raise NotFiniteError(f"step {step}: {name} holds {bad} non-finite value(s) of {t.numel()}")


def _autocast(config: TrainConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.mixed_precision == "bf16")


def _peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak GPU memory so far, in GiB (nothing on the CPU)."""
    if device.type != "cuda":
        return {}
    return {"peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)}


def _step_positions(step: int, config: TrainConfig) -> list[int]:
    """This process's share of the step's global batch: data positions step·B … step·B + B − 1, round robin."""
    first = step * config.batch_size
    return list(range(first + distributed.rank(), first + config.batch_size, distributed.world_size()))


def _prefill_calls(model, dataset, positions: list[int], config: TrainConfig) -> list[int | None]:
    """Per local sample, the most prefill chunks any process needs for its sample in that slot (ZeRO-3 only)."""
    if not distributed.is_sharded(model) or distributed.world_size() == 1:
        return [None] * len(positions)
    counts = []
    for pos in positions:
        item = dataset[sample_index(pos, len(dataset), config.seed)]
        prompt = split_sample(torch.as_tensor(item["input_ids"]), torch.as_tensor(item["labels"])).prompt
        counts.append(prefill_calls(prompt.shape[1], config.prefill_chunk))
    everyone = distributed.per_process(counts)
    return [int(c) for c in everyone.max(0).values]


def run_id(config: TrainConfig, data: dict[str, Any], model) -> str:
    """The run a checkpoint belongs to: a hash of the settings that decide the numbers (the config less what may
    change on resume, paths as file names), the seed among them, the data's hash and the model's architecture.
    Never the time or the place: the same run on another machine has the same id."""
    settings = {k: v for k, v in portable_config(config.to_dict()).items() if k not in _RESUMABLE_CHANGES}
    doc = {"config": settings, "data_sha256": data["sha256"], "model_sha256": config_sha256(model)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _difference(state: dict[str, Any], config: TrainConfig, model, data: dict[str, Any]) -> str | None:
    """What makes a checkpoint another run's, in words, or None."""
    if state.get("data_sha256") and state["data_sha256"] != data["sha256"]:
        return (f"the dataset differs: sha256 {state['data_sha256'][:12]}… in the checkpoint but "
                f"{data['sha256'][:12]}… now")
    if state.get("model_sha256") and state["model_sha256"] != config_sha256(model):
        return f"it was made for another model architecture ({state['config'].get('model')!r})"
    saved = portable_config(state["config"])
    for key, value in portable_config(config.to_dict()).items():
        if key not in _RESUMABLE_CHANGES and saved.get(key) != value:
            return f"{key} is {saved.get(key)!r} in the checkpoint but {value!r} now"
    return None


def check_resume(resume: str | Path, config: TrainConfig, data: dict[str, Any], model) -> Path:
    """The checkpoint ``resume`` names (``"latest"``: the newest of this output), once it is known to be there,
    readable and of this run; else a one-line :class:`rolecall.train.checkpoint.CheckpointError`. ``model`` may be the
    model's config alone (:func:`rolecall.core.models.load_config`), so the CLI checks before any weights load."""
    path = ckpt.latest_checkpoint(config.resolved_output()) if str(resume) == "latest" else Path(resume)
    state = ckpt.load_checkpoint(path)
    ckpt.check_run(state, path, run_id(config, data, model), _difference(state, config, model, data))
    return path


def _restore(state: dict[str, Any], gates, optimizer, generator) -> None:
    gates.load_state_dict(state["gates"])
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["gate_rng"])
    torch.set_rng_state(state["torch_rng"])
    if torch.cuda.is_available() and state.get("cuda_rng"):
        # the run may resume on fewer GPUs than it was saved on: restore the states of the devices there are
        for index, rng in enumerate(state["cuda_rng"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(rng, index)


def run(model, tokenizer, dataset, config: TrainConfig, resume: str | Path | None = None,
        data_info: dict[str, Any] | None = None, overwrite: bool = False) -> RoleManifest:
    """Learn head roles of ``model`` on ``dataset`` (items with 1-D ``input_ids`` and ``labels``).

    Writes ``.log.jsonl``, ``.config.json``, ``.gates.png`` and ``.curves.png`` next to
    ``config.resolved_output()``, then the manifest, by an atomic rename, last: a kill never pairs a new manifest
    with an earlier run's sidecars, and a run that fails before the end leaves an earlier manifest as it was.
    Checkpoints go under ``.ckpt/`` as it trains. ``resume``: a checkpoint path, or ``"latest"`` for the newest one
    of this output; it must be a checkpoint of the same run (``run_id``). A fresh run refuses an output that has a
    manifest or checkpoints unless ``overwrite``; the earlier run's checkpoints and log are then replaced only when
    this run writes its first checkpoint (or, with none, its manifest). Returns the manifest.
    """
    recipe = HeadRecipe(model, dataset, config)
    recipe.setup(resume, data_info, overwrite)
    with frozen(model), fast_float32_matmul(config.tf32), tqdm(total=config.steps, initial=recipe.start,
                                                                 desc="train-heads", dynamic_ncols=True,
                                                                 disable=not recipe.main) as bar:
        for step in range(recipe.start, config.steps):
            recipe.train_step(step)
            # E[L0] and λ of the gates after the step: the last values are the summary's
            bar.set_postfix(loss=f"{recipe.last_loss:.4g}", EL0=f"{recipe.expected_l0:.2f}", lam=f"{recipe.lam:.3g}")
            bar.update()
    return recipe.finalize()


class HeadRecipe:
    """``train-heads`` in three parts, as torchtune shapes a recipe: :meth:`setup` (checks, gates, optimizer,
    resumed state), :meth:`train_step` (one gate draw, the batch's distillation, the Lagrangian step, the log
    record and the checkpoint) and :meth:`finalize` (the sidecars, then the manifest)."""

    def __init__(self, model, dataset, config: TrainConfig) -> None:
        if len(dataset) == 0:
            raise ValueError("the dataset is empty; build it with at least one sample")
        self.model, self.dataset, self.config = model, dataset, config
        self.output = config.resolved_output()
        self.stem = self.output.with_name(self.output.name.removesuffix(".safetensors"))
        self.log_path = self.stem.with_name(self.stem.name + ".log.jsonl")
        self.num_layers, self.num_kv = _shape(model)
        if self.num_layers < 2:
            raise ValueError("the model has one layer; head roles need at least two (layer 0 is always retrieval)")
        self.layout = GateLayout.of(model, config.include_sliding)  # hybrid models: sliding layers' gates held open
        gated = self.layout.gated_heads(self.num_kv)
        if config.target > gated:
            raise ValueError(f"target {config.target} exceeds the {gated} gated heads of this model")
        self.world, self.main = distributed.world_size(), distributed.is_main()
        if config.batch_size % self.world:
            raise ValueError(f"batch_size {config.batch_size} does not split evenly over {self.world} processes; "
                             f"use a multiple of {self.world} (--batch-size)")
        self.start, self.lam, self.records, self.last_loss = 0, 0.0, [], math.nan
        self.expected_l0 = math.nan  # of the gates after the last step (the log has the one that step's λ update used)
        self.checkpoint: Path | None = None  # the newest checkpoint of this run: resumed from or written
        self.replacing = False  # an earlier run's checkpoint folder is there, to be replaced by this run's

    def setup(self, resume: str | Path | None, data_info: dict[str, Any] | None, overwrite: bool) -> None:
        config, model = self.config, self.model
        self.data = dataset_provenance(self.dataset, data_info)
        if resume is not None and overwrite:
            raise ValueError("--resume continues a run and --overwrite starts a new one over it; pass one of them")
        self.rid = run_id(config, self.data, model)
        if resume is None:  # nothing is removed here: an earlier run's files stay until this run has its own
            self.replacing = ckpt.claim_output(self.output, overwrite)
        self.device = distributed.model_device(model)
        torch.manual_seed(config.seed)
        self.gates = GateParameters(config.gate, (self.num_layers - 1, self.num_kv), config.low, config.high,
                                    fixed_open=self.layout.fixed_open(self.num_kv)).to(self.device)
        self.optimizer = torch.optim.Adam(self.gates.parameters(), lr=config.lr)
        self.generator = torch.Generator().manual_seed(config.seed)  # gate noise on the CPU: same draws anywhere
        self.hybrid = HybridAttention(self.num_layers, config.token_budget, checkpoint=config.gradient_checkpointing,
                                      sliding=self.layout.sliding)
        self.goal = self.gates.l0_goal(config.target, config.min_gate_prob)  # E[L0] that means `target` open gates
        self.progress = ckpt.progress_log(ckpt.checkpoint_dir(self.output))  # the steps so far, until the manifest
        if resume is not None:
            path = check_resume(resume, config, self.data, model)
            state = ckpt.load_checkpoint(path)
            _restore(state, self.gates, self.optimizer, self.generator)
            self.start, self.lam, self.checkpoint = state["step"], state["lambda"], path
            # the log saved with the checkpoint (written before it, so it may run ahead); older runs kept it
            # beside the manifest
            saved = ckpt.progress_log(path.parent)
            self.records = [r for r in ckpt.read_log(saved if saved.is_file() else self.log_path)
                            if r["step"] < self.start]

    def train_step(self, step: int) -> None:
        config = self.config
        began = time.perf_counter()
        dist = self.gates.distribution()
        z = dist.rsample(generator=self.generator)  # [L − 1, Hkv], the same draw on every process
        # each sample's backward stops at z (a leaf here), so samples are processed one at a time in memory;
        # their gradients meet in z_leaf.grad and then flow into the gate parameters once
        z_leaf = z.detach().requires_grad_(True)
        local_loss, bad = self._distill(step, z, z_leaf)
        l0 = dist.expected_l0()
        totals = torch.tensor([local_loss, float(len(bad))], dtype=torch.float64)
        distributed.all_reduce_sum_([totals])
        try:
            if bad or totals[1] > 0:  # the teacher's logits first: they say the model itself is the cause
                first = next((b for b in bad if b.startswith("teacher logits")), bad[0] if bad else None)
                raise NotFiniteError(f"step {step}: {first or 'a tensor of another process went bad'}")
            _check_finite(step, {"expected L0": l0})
            self.optimizer.zero_grad(set_to_none=True)
            grad_z = z_leaf.grad if z_leaf.grad is not None else torch.zeros_like(z_leaf)
            distributed.all_reduce_sum_([grad_z])  # Σ over the global batch of ∂(loss_i / B)/∂z
            torch.autograd.backward([z, self.lam * (l0 - self.goal)], [grad_z.to(z.dtype), None])
            _check_finite(step, {f"gradient of {n}": p.grad for n, p in self.gates.named_parameters()})
        except NotFiniteError as e:
            raise NotFiniteError(f"{e}; {self._stopped(str(e))}") from None
        self.optimizer.step()
        self.gates.constrain_(config.min_gate_prob)
        l0_value = float(l0.detach())
        self.lam = max(0.0, self.lam + config.lambda_lr * (l0_value - self.goal))
        self.last_loss = float(totals[0]) / config.batch_size
        self._record(step, l0_value, began)
        if (step + 1) % config.checkpoint_every == 0 and step + 1 < config.steps:
            self._save(step + 1)

    def _save(self, step: int) -> None:
        """The log so far, then the checkpoint of ``step`` (a kill between the two leaves a log ahead, never
        behind), by the main process; every process notes where it is. The first one of a run over an earlier
        run's folder is written into a new folder that then takes the old one's place
        (:func:`rolecall.train.checkpoint.replace_folder`)."""

        def write(folder: Path) -> Path:
            ckpt.write_log(ckpt.progress_log(folder), self.records)
            return _save_state(ckpt.checkpoint_file(folder, step), step, self.config, self.model, self.data,
                               self.gates, self.optimizer, self.generator, self.lam, self.rid)

        folder = ckpt.checkpoint_dir(self.output)
        if self.main and self.replacing:
            ckpt.replace_folder(self.output, write)
        elif self.main:
            write(folder)
        self.replacing, self.checkpoint = False, ckpt.checkpoint_file(folder, step)

    def _stopped(self, what: str) -> str:
        """What a run stopped by a non-finite value (``what``) kept and what to do next. With a checkpoint of its
        own the log so far goes beside it; with none nothing is written, so an earlier run's checkpoints and log
        stay as they were and no folder is left behind to block a rerun."""
        if "teacher logits" in what:
            cause = ("the model's own logits are not finite before any gate acts, so its weights or --dtype are the "
                     "cause, not the rates")
            fix = "fix the model or pass another --dtype"
        else:
            cause = "the gates or the multiplier diverged"
            fix = "lower --lr or --lambda-lr, or pass --mixed-precision no"
        if self.checkpoint is None:
            return (f"{cause}; training stopped with no checkpoint to resume from (nothing of this run was kept); "
                    f"{fix} and rerun with --overwrite")
        if self.main:
            ckpt.write_log(self.progress, self.records)  # the history that led here, beside the checkpoints
        return (f"{cause}; training stopped, its last checkpoint is {self.checkpoint} (--resume repeats the same "
                f"settings, which are part of the run); {fix} and rerun with --overwrite")

    def _distill(self, step: int, z: torch.Tensor, z_leaf: torch.Tensor) -> tuple[float, list[str]]:
        """This process's share of the batch: the summed distillation loss (each sample's gradient reaches
        ``z_leaf.grad``) and a line for every tensor that went non-finite."""
        config = self.config
        positions = _step_positions(step, config)
        calls = _prefill_calls(self.model, self.dataset, positions, config)
        local_loss, bad = 0.0, []
        for pos, n_calls in zip(positions, calls):
            item = self.dataset[sample_index(pos, len(self.dataset), config.seed)]
            ids, labels = torch.as_tensor(item["input_ids"]), torch.as_tensor(item["labels"])
            with _autocast(config, self.device):
                loss_d, seen = distill_loss(self.model, self.hybrid, z_leaf, ids, labels, config.prefill_chunk,
                                            n_calls)
            bad += [f"{name} holds {int((~torch.isfinite(t)).sum())} non-finite value(s) of {t.numel()}"
                    for name, t in {"gates z": z, **seen, "distillation loss": loss_d}.items()
                    if t is not None and not bool(torch.isfinite(t).all())]
            (loss_d / config.batch_size).backward()
            local_loss += float(loss_d.detach())
        return local_loss, bad

    def _record(self, step: int, l0_value: float, began: float) -> None:
        config = self.config
        with torch.no_grad():
            after = self.gates.distribution()
            ez = after.expected_gate().float().cpu()
            self.expected_l0 = float(after.expected_l0())
        samples = [sample_index(p, len(self.dataset), config.seed)
                   for p in range(step * config.batch_size, (step + 1) * config.batch_size)]
        self.records.append({"step": step, "distill_loss": self.last_loss, "expected_l0": l0_value,
                             "lambda": self.lam, "sample": samples[0] if len(samples) == 1 else samples,
                             "seconds": round(time.perf_counter() - began, 4), **_peak_memory(self.device),
                             "expected_gate": [round(x, 6) for x in ez.flatten().tolist()]})

    def finalize(self) -> RoleManifest:
        config, records = self.config, self.records
        if records and self.start >= config.steps:  # resumed at the last step: nothing left to train
            self.last_loss = records[-1]["distill_loss"]
        with torch.no_grad():
            final = self.gates.distribution()
            ez = final.expected_gate().float().cpu()
            held = self.layout.fixed_open(self.num_kv)
            learned = torch.ones_like(ez, dtype=torch.bool) if held is None else ~held
            tail = records[-max(1, len(records) // 10):]
            metrics = {
                "steps": config.steps,
                "final_loss": self.last_loss,
                "final_loss_mean_last_10pct": float(np.mean([r["distill_loss"] for r in tail])),
                "expected_l0": float(final.expected_l0()),
                "expected_l0_goal": self.goal,
                "lambda": self.lam,
                # over the learned gates only: gates held open (sliding layers) are decided by construction
                "fraction_undecided": float(((ez > UNDECIDED[0]) & (ez < UNDECIDED[1]))[learned].float().mean()),
                "gate": config.gate,
            }
            manifest = build_manifest(self.model, final, config, metrics, self.data)
        if not self.main:
            return manifest
        self._publish(manifest, learned)
        return manifest

    def _publish(self, manifest: RoleManifest, learned: torch.Tensor) -> None:
        """The sidecars first, each atomically, then the manifest by its atomic rename: a kill at any point leaves
        the earlier manifest (with some of the new sidecars) or the new manifest with all of its own, never a new
        manifest beside an earlier run's sidecars. The plots are drawn into a hidden folder beside the output
        before anything is published, so a plot that fails leaves every earlier file as it was. Last, an earlier
        run's checkpoints that this run never replaced (it wrote none) go: they belong to the manifest just
        replaced."""
        config, records, stem = self.config, self.records, self.stem
        self.output.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{stem.name}.plots.", dir=self.output.parent) as drawn:
            plots = []
            if config.plots and records:
                plots = [plot_gates(records, (self.num_layers, self.num_kv), Path(drawn) / "gates.png"),
                         plot_curves(records, config.target, Path(drawn) / "curves.png", self.goal,
                                     learned.flatten().tolist())]
            ckpt.write_log(self.log_path, records)
            write_text(stem.with_name(stem.name + ".config.json"), config_json(config))
            for png in plots:  # written atomically (fsync, mode 0644) in the same folder: a rename places each
                os.replace(png, stem.with_name(f"{stem.name}.{png.name}"))
        manifest.save(self.output)
        if self.replacing:
            ckpt.remove_folder(self.output)
            self.replacing = False


def _save_state(path, step, config, model, data, gates, optimizer, generator, lam, rid) -> Path:
    state = {
        "format": "rolecall.train-heads",
        "run_id": rid,
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
    }
    return ckpt.save_checkpoint(path, state)
