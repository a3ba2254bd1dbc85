"""Processes, reductions and model placement for runs spread over GPUs with ``accelerate launch``/``torchrun``.

rolecall keeps only small state of its own: calibration sums and the gate parameters of ``train-heads``.
Both are replicated on every process and reduced with ``torch.distributed``; the frozen model is either
replicated (one copy per GPU: DDP-style data parallelism, also what ZeRO-1/2 amount to when nothing of the
model trains) or sharded by DeepSpeed ZeRO-3, which gathers each layer's weights just before it runs, in the
forward and in the backward pass into the gates.

Where the DeepSpeed config comes from, first match wins: ``--deepspeed FILE`` (a path or a name in
``configs/deepspeed/``), then what ``accelerate launch --config_file configs/accelerate/zero3.yaml`` passes
in the environment.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rolecall.core.configfile import read_config, shipped


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist else 1


def rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def is_main() -> bool:
    return rank() == 0


def launched_world_size() -> int:
    """The process count a launcher asked for (before any process group exists)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# what `torchrun` and `accelerate launch` set for each process they start, and DeepSpeed reads to join them
LAUNCHER_ENVIRONMENT = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def started_by_launcher() -> bool:
    """Whether a launcher started this process (its environment is set) or a process group already exists: what
    DeepSpeed needs to join one without looking for MPI."""
    return all(name in os.environ for name in LAUNCHER_ENVIRONMENT) or _dist() is not None


def init_from_launcher() -> torch.device | None:
    """Join the process group that ``accelerate launch``/``torchrun`` set up; the device of this process.

    None when the process was started alone (no ``WORLD_SIZE`` > 1 in the environment).
    """
    if launched_world_size() <= 1:
        return None
    from accelerate import PartialState

    return PartialState().device


def _reduce_device(t: torch.Tensor) -> torch.device:
    dist = _dist()
    if dist is not None and dist.get_backend() == "nccl":  # NCCL reduces only on the GPU, gloo only on the CPU
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum_(tensors: Iterable[torch.Tensor | None]) -> None:
    """Sum each tensor over all processes, in place (no-op for one process); ``None`` entries are skipped."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return
    for t in tensors:
        if t is None:
            continue
        device = _reduce_device(t)
        if t.device == device:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        else:
            moved = t.to(device)
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            t.copy_(moved.to(t.device))


# ----------------------------------------------------------------------------------------------- DeepSpeed

def shipped_deepspeed_configs() -> dict[str, Path]:
    return shipped("deepspeed")


def read_deepspeed_config(name_or_path: str) -> dict[str, Any]:
    """A DeepSpeed config file, or the name of one in ``configs/deepspeed/``."""
    return read_config(name_or_path, "DeepSpeed config", "deepspeed")


def deepspeed_config_from_environment() -> dict[str, Any] | None:
    """The DeepSpeed config ``accelerate launch`` handed this process, if it did."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path:
        return read_deepspeed_config(path)
    stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
    section: dict[str, Any] = {"stage": stage}
    offload = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")
    if stage == 3 and offload != "none":
        section["offload_param"] = {"device": offload, "pin_memory": True}
    return {"zero_optimization": section}


def deepspeed_config(deepspeed: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """The DeepSpeed config in force: ``deepspeed`` (a dict, a path or a shipped name), else what ``accelerate
    launch`` passed in the environment, else None."""
    if isinstance(deepspeed, str):
        return read_deepspeed_config(deepspeed)
    return deepspeed if deepspeed is not None else deepspeed_config_from_environment()


def zero_stage(config: dict[str, Any] | None) -> int:
    return int(((config or {}).get("zero_optimization") or {}).get("stage", 0))


def frozen_model_config(config: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """A DeepSpeed config for a model that is only run, never optimised (the gates train outside it).

    ``"auto"`` values are filled: batch sizes are 1 per process (DeepSpeed's batch bookkeeping is unused),
    the precision follows the model's dtype, and optimizer and scheduler sections are dropped.
    """
    out = json.loads(json.dumps(config))
    for key in ("optimizer", "scheduler", "train_batch_size"):
        out.pop(key, None)
    out["train_micro_batch_size_per_gpu"] = 1
    out["gradient_accumulation_steps"] = 1
    out["bf16"] = {"enabled": dtype == torch.bfloat16}
    out["fp16"] = {"enabled": dtype == torch.float16}
    zero = out.setdefault("zero_optimization", {})
    for key, value in list(zero.items()):
        if value == "auto":  # sizes DeepSpeed would derive from the hidden size: its defaults suit a frozen model
            del zero[key]
    if zero.get("stage", 0) != 3:
        raise ValueError(f"ZeRO stage {zero.get('stage', 0)} does not shard a frozen model (only ZeRO-3 does); "
                         "use configs/deepspeed/zero3.json, or plain data parallelism without DeepSpeed")
    return out


def _torch_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    return getattr(torch, str(dtype))


def random_model(config: Any, dtype: torch.dtype, device: torch.device | str | None = None,
                 device_map: Any = None, seed: int = 0):
    """The architecture of ``config`` with seeded random weights, built where it will run: for speed and memory
    measurements, never for quality.

    Never the whole model in host memory first: inside a DeepSpeed ZeRO-3 context (``HfDeepSpeedConfig``)
    ``zero.Init`` draws and splits each layer as it is built; with ``device_map`` the model is built on the meta
    device, each placed module is allocated on its device and initialised there, then dispatched as
    ``from_pretrained(device_map=...)`` dispatches loaded weights; otherwise it is drawn on ``device``.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if device_map is None:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
        return model.eval()
    from accelerate import dispatch_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    placement = _placement(model, device_map, dtype)
    for name, where in placement.items():
        (model.get_submodule(name) if name else model).to_empty(device=where)
    for item in [*model.modules(), *model.parameters(), *model.buffers()]:
        item._is_hf_initialized = False  # the meta build marked them done; draw them now that they have storage
    model.initialize_weights()
    model.tie_weights()
    return dispatch_model(model, device_map=placement).eval()


def _placement(model, device_map: Any, dtype: torch.dtype) -> dict[str, Any]:
    """``device_map`` as a module → device table, worked out as ``from_pretrained`` does for its strategies."""
    if isinstance(device_map, dict):
        return device_map
    if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
        return {"": device_map}  # one device: "cuda:1", "cpu"
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    no_split = model._no_split_modules
    memory = None if device_map == "sequential" else get_balanced_memory(
        model, dtype=dtype, low_zero=device_map == "balanced_low_0", no_split_module_classes=no_split)
    return infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split, dtype=dtype)


def load_frozen_model(name: str, dtype: Any = None, device_map: Any = None, random_weights: bool = False,
                      deepspeed: str | dict[str, Any] | None = None, device: torch.device | str | None = None,
                      trust_remote_code: bool = False):
    """The model of ``name``, placed for this process: replicated on its device, split over the GPUs by
    ``device_map``, or sharded by ZeRO-3.

    ``random_weights``: build the architecture of ``name`` (an alias, id, folder or ``config.json``) with
    random weights (:func:`random_model`), placed the same ways.
    ``deepspeed``: a config (dict, path or shipped name) whose ZeRO-3 section shards the weights over the
    processes; None looks at what ``accelerate launch`` passed. Returns the model to call (for ZeRO-3 the
    engine's module, whose hooks gather each layer's weights when it runs).
    """
    from rolecall.core.models import load_config, load_model

    ds = deepspeed_config(deepspeed)
    if zero_stage(ds) < 3:
        ds = None  # ZeRO-1/2 partition optimizer state and gradients, which a frozen model has none of
    torch_dtype = _torch_dtype(dtype)
    keep_alive = None
    if ds is not None:
        if device_map is not None:
            raise ValueError("--device-map and ZeRO-3 both place the weights; use one of them")
        ds = frozen_model_config(ds, torch_dtype)
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(ds)  # while it lives, transformers builds the model already sharded
    if random_weights:
        where = device if ds is None else None
        model = random_model(load_config(name), torch_dtype or torch.float32, where, device_map)
    else:
        model = load_model(name, dtype=dtype, device_map=device_map, trust_remote_code=trust_remote_code)
    if ds is None:
        if device_map is None and device is not None:
            model.to(device)
        return model
    import deepspeed as _deepspeed

    engine, *_ = _deepspeed.initialize(model=model, config=ds)
    module = engine.module
    module.eval()
    module.rolecall_deepspeed = engine  # keep the engine (and its hooks) alive with the module
    module.rolecall_ds_config = keep_alive
    return module


def per_process(values: list[float]) -> torch.Tensor:
    """Every process's ``values`` as a [world, n] table, row r from process r (each process passes n values)."""
    table = torch.zeros(world_size(), len(values), dtype=torch.float64)
    table[rank()] = torch.tensor(values, dtype=torch.float64)
    all_reduce_sum_([table])  # each process filled only its own row, so the sum holds everyone's
    return table


def pad_forwards(model, input_ids: torch.Tensor, count: int) -> None:
    """Run ``model`` ``count`` times on the first token of ``input_ids``, touching no cache.

    Under ZeRO-3 every process must run the same sequence of layers (each gathers its weights collectively): a
    process with less work pads up to the busiest one's forward count.
    """
    with torch.no_grad():
        for _ in range(max(count, 0)):
            model(input_ids=input_ids[:, :1], use_cache=False, logits_to_keep=1)


def is_sharded(model: torch.nn.Module) -> bool:
    return getattr(model, "rolecall_deepspeed", None) is not None


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model computes: a ZeRO-3 model's own parameters are placeholders (maybe offloaded)."""
    if is_sharded(model):
        return torch.device(model.rolecall_deepspeed.device)  # the process's accelerator (the CPU in tests)
    return next(model.parameters()).device
