"""``train-heads`` (= ``rolecall train``): learn retrieval heads with HardKuma gates and write a manifest.

Flags override the YAML given by ``--config``, which overrides the defaults of ``rolecall.train.config.TrainConfig``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from rolecall.cli import script_parser
from rolecall.train.config import MIXED_PRECISION, TrainConfig, build_config, read_yaml, shipped_configs


def _budget(text: str) -> float | int:
    """``0.3`` is a fraction of the sequence, ``4096`` a token count."""
    try:
        count = int(text)
    except ValueError:
        pass
    else:
        if count < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is no token count; pass a count >= 1 (4096) or a fraction "
                                             "in (0, 1] (0.3)")
        return count
    try:
        fraction = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a fraction (0.3) nor a token count (4096)") from None
    if not 0 < fraction <= 1:  # nan and inf too
        raise argparse.ArgumentTypeError(f"{text!r} is no fraction of the sequence; pass a fraction in (0, 1] (0.3) "
                                         "or a whole token count (4096)")
    return fraction


def _rate(name: str):
    """The argparse type of a rate flag: a finite number in its range (:data:`rolecall.train.config.RATE_FLAGS`), else a
    usage error naming the value, the range and an example."""
    from rolecall.train.config import rate_fix, rate_problem

    def parse(text: str) -> float:
        problem = rate_problem(name, text)
        if problem:
            raise argparse.ArgumentTypeError(f"{text!r} {problem}; pass {rate_fix(name)}")
        return float(text)

    parse.__name__ = name  # argparse names the type in some messages
    return parse


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 0.5:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability in [0, 0.5); pass e.g. 0.01, or 0 to turn "
                                         "the bound off")
    return value


def _lengths(text: str) -> tuple[int, int]:
    parts = text.replace(":", ",").split(",")
    try:
        lo, hi = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW,HIGH (e.g. 1000,10000)") from None
    return lo, hi


def _add_placement(p: argparse.ArgumentParser) -> None:
    """Where and in what precision the frozen model runs: one device, a device map or ZeRO-3."""
    from rolecall.core.models import DTYPES

    p.add_argument("--mixed-precision", choices=MIXED_PRECISION, help="accelerate mixed precision (default no)")
    p.add_argument("--no-tf32", dest="tf32", action="store_false", default=None,
                   help="exact float32 attention scores on GPUs (default: TF32 tensor cores)")
    p.add_argument("--dtype", choices=DTYPES, help="model weight dtype (default: the alias's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--device-map", help="'auto' spreads a model that does not fit one GPU over all visible GPUs")
    p.add_argument("--deepspeed", metavar="CONFIG",
                   help="shard the frozen model with this DeepSpeed ZeRO-3 JSON (path or name in configs/deepspeed/); "
                        "under `accelerate launch` the config file's DeepSpeed section is used without this flag")
    p.add_argument("--random-weights", action="store_true", default=None,
                   help="the model's architecture with random weights (speed and memory measurements only)")
    p.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false", default=None,
                   help="keep attention scores for backward instead of recomputing them (faster, more memory); the "
                        "reference attention only: on a GPU the fused kernels keep no scores either way")


def add_arguments(p: argparse.ArgumentParser) -> None:

    # the effective defaults: the dataclass's, then the default model's shipped config (configs/train/<model>.yaml,
    # which a run without --model and --config reads), without building a config (that checks the gate name
    # against rolecall.train.gates, which imports torch: --help stays fast)
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    shipped_for_model = shipped_configs().get(defaults["model"])
    if shipped_for_model is not None:
        defaults.update({k: v for k, v in read_yaml(str(shipped_for_model)).items() if k in defaults})
    d = argparse.Namespace(**defaults)
    p.add_argument("--config", help="YAML of options: a path or a name in configs/train/, <model> or "
                   "<model>.<variant> (e.g. llama3-8b-1048k.sigmoid) [configs/train/<model>.yaml when it exists]")
    p.add_argument("--model", help=f"alias, Hugging Face id, local folder or .gguf file (default {d.model})")
    p.add_argument("--model-name", help="name recorded in the manifest (default: the --model value)")
    p.add_argument("--target", type=int, help=f"retrieval heads wanted among layers >= 1 (default {d.target})")
    p.add_argument("--steps", type=int, help=f"training steps (default {d.steps})")
    p.add_argument("--batch-size", type=int,
                   help=f"samples per step, split over the processes of a multi-GPU run (default {d.batch_size})")
    p.add_argument("--gate", help=f"hardkuma, hardconcrete or sigmoid (default {d.gate})")
    p.add_argument("--lr", type=_rate("lr"), help=f"Adam learning rate of the gates (default {d.lr}; at most 10)")
    p.add_argument("--lambda-lr", type=_rate("lambda_lr"),
                   help=f"ascent rate of the Lagrange multiplier (default {d.lambda_lr}; at most 1e6)")
    p.add_argument("--min-gate-prob", type=_probability,
                   help=f"keep every gate's P(z = 0) in [p, 1 - p] so no gate freezes, and drive E[L0] to "
                   f"TARGET (1 - 2p) + n p, what TARGET decided gates of n count; 0 turns it off (default {d.min_gate_prob})")
    p.add_argument("--token-budget", type=_budget,
                   help=f"sparse heads' tokens: a fraction of the sequence or a count (default {d.token_budget})")
    p.add_argument("--prefill-chunk", type=int, help=f"teacher prefill chunk in tokens (default {d.prefill_chunk})")
    p.add_argument("--exact-target", action="store_true", default=None,
                   help="mark exactly the top-TARGET heads by E[z] as retrieval (default: E[z] > 0.5)")
    p.add_argument("--seed", type=int, help=f"seed of gate noise and data order (default {d.seed})")
    p.add_argument("--checkpoint-every", type=int, help=f"steps between checkpoints (default {d.checkpoint_every})")
    p.add_argument("--resume", nargs="?", const="latest", metavar="CKPT",
                   help="continue from a checkpoint of the same run (the newest of this output when no path is given)")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh over an output that has a manifest or checkpoints (they are replaced when "
                   "this run writes its first checkpoint or its manifest; a run that fails before leaves them)")
    _add_placement(p)
    p.add_argument("--dataset", help="'passkey' (default) or a .jsonl file of {input_ids, labels} records")
    p.add_argument("--data-source", help=f"haystack corpus of the passkey data (default {d.data_source})")
    p.add_argument("--lengths", type=_lengths, help=f"passkey haystack lengths LOW,HIGH in tokens (default {','.join(map(str, d.lengths))})")
    p.add_argument("--num-samples", type=int, help=f"passkey samples (default {d.num_samples})")
    p.add_argument("--num-passkeys", type=int, help=f"passkeys per sample (default {d.num_passkeys})")
    p.add_argument("--passkey-words", type=int, help=f"words per passkey (default {d.passkey_words})")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model folder's own Python code (auto_map in config.json); off by default")
    p.add_argument("--allow-long-context", action="store_true",
                   help="accept samples longer than the model's context (max_position_embeddings) with only a "
                   "warning: for a model whose RoPE you extended on purpose")
    p.add_argument("--include-sliding", action="store_true", default=None,
                   help="hybrid models: gate sliding-window layers too (default: held open, not counted)")
    p.add_argument("--output", help="manifest path (default artifacts/<model>.heads.safetensors)")
    p.add_argument("--no-plots", dest="plots", action="store_false", default=None, help="skip the PNG plots")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = [f for f in TrainConfig.__dataclass_fields__ if hasattr(args, f)]
    return build_config(args.config, **{n: getattr(args, n) for n in names})


class JsonlDataset:
    """Records ``{"input_ids": [...], "labels": [...]}``, one per line."""

    def __init__(self, path: str | Path):
        import torch

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"dataset {str(path)!r} is not a file; pass --dataset passkey or a .jsonl file")
        self.path, self.items = path, []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                self.items.append({k: torch.tensor(rec[k], dtype=torch.long) for k in ("input_ids", "labels")})
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise ValueError(f"{path}:{n}: not a record with integer lists input_ids and labels") from None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def load_dataset(config: TrainConfig, tokenizer) -> tuple[Any, dict[str, Any]]:
    if config.dataset != "passkey":
        return JsonlDataset(config.dataset), {"kind": "jsonl", "path": config.dataset}
    try:
        from rolecall.data.passkey import build_passkey_dataset
    except ImportError as e:
        raise ValueError(f"the passkey dataset needs the data package ({e}); pass --dataset FILE.jsonl instead") from None
    info = {"kind": "passkey", "source": config.data_source, "lengths": list(config.lengths),
            "num_samples": config.num_samples, "num_passkeys": config.num_passkeys,
            "passkey_words": config.passkey_words, "seed": config.seed}
    ds = build_passkey_dataset(tokenizer, source=config.data_source, lengths=config.lengths,
                               num_samples=config.num_samples, num_passkeys=config.num_passkeys,
                               passkey_words=config.passkey_words, seed=config.seed)
    return ds, info


def run(args: argparse.Namespace) -> int:
    import torch

    from rolecall.cli.common import check_placement, chosen_device, wall_time_line
    from rolecall.core import distributed
    from rolecall.core.atomic import check_writable
    from rolecall.core.models import load_config, load_tokenizer
    from rolecall.train.config import check_dataset, check_settings
    from rolecall.train.recipe import run as train_run

    start = time.perf_counter()
    config = config_from_args(args)
    overwrite = getattr(args, "overwrite", False)
    if args.resume is not None and overwrite:
        raise ValueError("--resume continues a run and --overwrite starts a new one over it; pass one of them")
    if args.resume is None:
        from rolecall.train.checkpoint import claim_output

        claim_output(config.resolved_output(), overwrite)  # an output taken by another run fails before anything loads
    check_writable(config.resolved_output(), "--output")  # checkpoints go beside it from the first interval on
    wanted = chosen_device(args)  # a device this machine lacks: refused before anything loads
    check_placement("train-heads", config.device_map, config.deepspeed)
    model_cfg = load_config(config.model, args.trust_remote_code)  # --target, --lengths: before any work
    limit = check_settings(config, model_cfg, args.allow_long_context)
    launched = distributed.init_from_launcher()  # accelerate launch / torchrun: one process per GPU
    device = launched or torch.device(wanted)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    # a JSONL dataset is already tokenized: a model given by its architecture alone needs no tokenizer
    trust = args.trust_remote_code
    tokenizer = None if config.dataset != "passkey" else load_tokenizer(config.model, trust_remote_code=trust)
    began = time.perf_counter()
    dataset, info = load_dataset(config, tokenizer)  # before the model: bad data fails fast
    times = {"load": 0.0, "data": time.perf_counter() - began}  # load: set once the model is in
    check_dataset(dataset, config, model_cfg, limit, args.allow_long_context)
    resume = args.resume
    if resume is not None:  # the checkpoint: there, readable and of this run, before the model loads
        from rolecall.train.outputs import dataset_provenance
        from rolecall.train.recipe import check_resume

        resume = check_resume(resume, config, dataset_provenance(dataset, info), model_cfg)
    model = distributed.load_frozen_model(config.model, dtype=config.dtype, device_map=config.device_map,
                                          random_weights=config.random_weights, deepspeed=config.deepspeed,
                                          device=device, trust_remote_code=trust)
    times["load"] = time.perf_counter() - start - times["data"]  # the checks, the tokenizer and the model
    began = time.perf_counter()
    manifest = train_run(model, tokenizer, dataset, config, resume=resume, data_info=info, overwrite=overwrite)
    times["training (checkpoints and the manifest written)"] = time.perf_counter() - began
    if distributed.is_main():
        m = manifest.metrics
        print(f"wrote {config.resolved_output()}: {m['retrieval_heads']} retrieval heads (+ layer 0), "
              f"E[L0] {m['expected_l0']:.2f} (goal {m['expected_l0_goal']:.2f}), λ {m['lambda']:.4g}, final loss {m['final_loss']:.4g}, "
              f"undecided {100 * m['fraction_undecided']:.1f} %"
              + (f", {distributed.world_size()} processes" if distributed.world_size() > 1 else ""))
        verdict = convergence(m)
        if verdict:
            print(verdict)
        print(wall_time_line("train-heads", time.perf_counter() - start, times))
    return 0


UNCONVERGED_UNDECIDED = 0.10  # more undecided gates than this: the roles are not settled
UNCONVERGED_L0 = 0.10  # |E[L0] - goal| above this share of the goal (at least 1 head): the target is not met


def convergence(metrics: dict) -> str | None:
    """One line saying how far from converged a run ended, or None when it looks converged: the share of gates
    still undecided and how far E[L0] sits from its goal, and where converged manifests are."""
    undecided, gap = metrics["fraction_undecided"], abs(metrics["expected_l0"] - metrics["expected_l0_goal"])
    if undecided <= UNCONVERGED_UNDECIDED and gap <= max(1.0, UNCONVERGED_L0 * metrics["expected_l0_goal"]):
        return None
    return (f"not converged after {metrics['steps']} steps: {100 * undecided:.0f} % of the gates are undecided "
            f"(E[z] between 0.05 and 0.95; at most {100 * UNCONVERGED_UNDECIDED:.0f} % counts as settled) and E[L0] "
            f"is {gap:.1f} heads from its goal; the recipes train for thousands of steps (configs/train/), and "
            "converged manifests of the embedded model ship in artifacts/smollm2-135m/heads-*.safetensors")


def build_parser() -> argparse.ArgumentParser:
    return script_parser("train-heads", __doc__.split("\n")[0], add_arguments)


def main(argv: list[str] | None = None) -> int:
    from rolecall.cli import run_reporting_errors

    return run_reporting_errors("train-heads", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
