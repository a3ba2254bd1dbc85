"""What ``rolecall decode`` and ``rolecall eval`` share: the model, manifest and policy flags and their checks; the
device, dtype and placement checks that ``calibrate-delta`` and ``train-heads`` share with them; and the check of
numeric flags that ``rolecall grid`` and the benchmark scripts share."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rolecall.core.models import DEFAULT_MODEL, DTYPES


def parse_params(pairs: list[str] | None) -> dict[str, Any]:
    """``["budget=1024", "ratio=0.1", "mode=x"]`` → ``{"budget": 1024, "ratio": 0.1, "mode": "x"}``."""
    params: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {pair!r}: write it as NAME=VALUE, e.g. --param budget=1024")
        for kind in (int, float):
            try:
                params[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            params[key] = {"true": True, "false": False, "none": None}.get(value.lower(), value)
    return params


def policy_inputs(args: argparse.Namespace, config: Any = None) -> tuple[dict[str, Any], Any]:
    """``-p`` parameters and the ``--manifest`` of ``decode``/``eval``/``serve``, checked before the model loads: a
    bad policy name or parameter, or a bad manifest file, fails here in one line; with the model's ``config`` also
    what :func:`check_policy` checks. Without ``--policy``, ``args.policy`` becomes the manifest's recommended
    setting's (its parameters under the ``-p`` ones, said in one line on stderr) or delta."""
    from rolecall.core.manifest import RoleManifest
    from rolecall.runtime.session import chosen_setting

    params = parse_params(args.param)
    manifest = RoleManifest.load(args.manifest) if args.manifest else None
    args.policy, params, line = chosen_setting(args.policy, manifest, params)
    if line:
        print(line, file=sys.stderr)
    check_policy(args.policy, params, manifest, config)
    return params, manifest


def check_policy(name: str, params: dict[str, Any], manifest: Any = None, config: Any = None) -> None:
    """What ``attach()`` checks before it decodes, without the weights: the policy ``name`` made from ``params``
    (the session's own keys left out), and with the model's ``config`` (:func:`rolecall.core.models.load_config`) the
    manifest against the model and the policy against the manifest (a manifest of another model, delta without
    layer roles, lychee without head roles). Raises the error ``attach()`` would."""
    from rolecall.runtime.policies import get_policy
    from rolecall.runtime.session import SESSION_PARAMS, bound_policy

    own = {k: v for k, v in params.items() if k not in SESSION_PARAMS}
    if config is None:
        get_policy(name, **own)
    else:
        bound_policy(name, manifest, config, **own)


def add_model(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--trust-remote-code``."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"alias, Hugging Face id or local folder (default {DEFAULT_MODEL})")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the model folder's own Python code (auto_map in config.json); off by default")


def add_manifest(parser: argparse.ArgumentParser, help: str, required: bool = False) -> None:
    """``--manifest``, a role manifest file (.safetensors); ``help`` says what the command reads from it."""
    parser.add_argument("--manifest", required=required, default=None, help=help)


def add_device(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--device`` (``note`` added to its help) and ``--dtype``: what :func:`load_placed` reads."""
    parser.add_argument("--device", default=None, help=f"cuda or cpu (default: cuda when there is one){note}")
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="weights dtype (default: bfloat16 on cuda, float32 on cpu)")


def add_common(parser: argparse.ArgumentParser) -> None:
    add_model(parser)
    add_manifest(parser, "role manifest (.safetensors): delta needs layers.role, lychee heads.role, lethe "
                 "layers.budget unless -p budget=N or -p sparse_ratio=F; full and vattention run without")
    parser.add_argument("--policy", default=None, help="full, delta, lychee, lethe, vattention or quest (default: the "
                        "manifest's recommended setting from rolecall tune when it has one, else delta)")
    parser.add_argument("--param", "-p", action="append", metavar="NAME=VALUE",
                        help="policy parameter, repeatable (e.g. -p budget=1024, -p ratio=0.1, -p epsilon=0.05)")
    add_device(parser, "; on cuda full, delta, lychee, quest, lethe (with -p budget=) and vattention (with -p "
               "max_sample=) run on the engine (static cache, CUDA graphs)")
    parser.add_argument("--device-map", default=None, metavar="MAP",
                        help="'auto' spreads a model too large for one GPU over every visible GPU (from_pretrained's "
                        "device_map; also balanced, sequential or a device); a model spread over several decodes on "
                        "the transformers path, since the engine runs a model on one GPU")


def add_prompt_arguments(parser: argparse.ArgumentParser, *, passkey_words: int, alphabet: str, limit: int) -> None:
    """The prompt, suite and long-context flags that ``rolecall eval`` and ``benchmarks/quality.py`` share; the
    defaults that differ between them are the arguments."""
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000], help="passkey context lengths")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="passkey depths in [0, 1]")
    parser.add_argument("--samples-per-cell", type=int, default=1,
                        help="prompts per (length, depth), or per (task, length) with --suite ruler")
    parser.add_argument("--passkey-words", type=int, default=passkey_words)
    parser.add_argument("--alphabet", default=alphabet, choices=("nato", "digits"),
                        help="passkey words: NATO code words, or digits (small models copy digits, not words)")
    parser.add_argument("--source", default="pg-essays", help="haystack text (see rolecall.data.corpora)")
    parser.add_argument("--suite", default="passkey", choices=("passkey", "ruler", "longbench", "reasoning"),
                        help="passkey: the single-passkey grid (--lengths x --depths); ruler: the RULER-style suite "
                             "of rolecall.data.ruler (--tasks x --lengths, --samples-per-cell each), generated offline; "
                             "longbench: LongBench's English tasks (--data, or the Hugging Face Hub when it answers; "
                             "the first --samples-per-cell of each task, cut to each of --lengths); "
                             "reasoning: full attention's own greedy traces on reasoning prompts, the policy fed the "
                             "same tokens (per-step KL, top-1 agreement, divergence point)")
    parser.add_argument("--data", default=None,
                        help="--suite longbench: LongBench's data.zip or the folder of its <task>.jsonl files "
                             "(default: download it from the Hugging Face Hub when it answers)")
    parser.add_argument("--reasoning-source", default="champ",
                        help="reasoning prompts: champ, arithmetic[:N] or jsonl:PATH (see rolecall.data.reasoning)")
    parser.add_argument("--limit", type=int, default=limit, help=f"reasoning prompts to use (default {limit})")
    parser.add_argument("--tasks", nargs="+", default=None,
                        help="RULER or LongBench tasks (default: all; see rolecall.data.ruler, rolecall.data.longbench)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the RULER prompts")
    parser.add_argument("--prompts", default=None, help='JSONL file of {"prompt": ..., "answer": ...} (or '
                                                        '"answers": [...]) instead of generated prompts')
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens generated per prompt (default 12; 1024 for --suite reasoning; RULER tasks carry "
                             "their own: 128 for needles, 30, 120, 50)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="prompts of one length decoded together on the engine [16 on a GPU, 1 elsewhere]")
    parser.add_argument("--rope-theta", type=float, default=None,
                        help="another RoPE base for the model (run it past its trained context, with "
                        "--allow-long-context), e.g. 400000 for SmolLM2 at 16K-32K")
    add_long_context(parser)


def add_long_context(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-long-context", action="store_true",
                        help="run prompts longer than the model's context (max_position_embeddings) with only a "
                        "warning: for a model whose RoPE you extended on purpose")


def check_prompt_arguments(args: argparse.Namespace) -> None:
    """The defaults that depend on other flags, then bad values refused in one line (``ValueError``)."""
    if args.max_new_tokens is None:
        args.max_new_tokens = 1024 if args.suite == "reasoning" else 12
    for flag in ("samples_per_cell", "passkey_words"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    check_batch_size(args)
    if args.rope_theta is not None and args.rope_theta <= 0:
        raise ValueError(f"--rope-theta must be a positive number, got {args.rope_theta}")
    if args.prompts and not Path(args.prompts).is_file():
        raise ValueError(f'--prompts {args.prompts}: no such file; give a JSONL file of {{"prompt": ..., "answer": ...}} '
                         "lines")


def check_sampling_flags(sample: bool, given: dict[str, Any], greedy: str) -> None:
    """Sampling flags (``given``: flag -> value, None where left out) that greedy generation would ignore: refused in
    one line naming them (``ValueError``) unless ``sample``. ``greedy``: what is greedy without ``--sample``."""
    named = [f"{flag} {value}" for flag, value in given.items() if value is not None]
    if named and not sample:
        one = len(named) == 1
        raise ValueError(f"{', '.join(named)} {'applies' if one else 'apply'} only when sampling, and {greedy} "
                         f"without --sample; add --sample, or leave {'it' if one else 'them'} out")


def check_batch_size(args: argparse.Namespace) -> None:
    """``--batch-size``: at least 1, and 1 where the flags send the prompts one at a time (``ValueError``)."""
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if (args.batch_size or 1) > 1 and (why := one_at_a_time(args)):
        raise ValueError(f"--batch-size {args.batch_size}: {why}, which decodes one prompt at a time; "
                         "leave --batch-size out or pass 1")


def one_at_a_time(args: argparse.Namespace) -> str | None:
    """Why these flags take the transformers path (no batches), or None: ``--measure``, ``-p engine=reference``, or
    the CPU unless ``-p engine=static``. Known before the model loads, so a batch size that cannot run is refused
    before the prompts are built."""
    if getattr(args, "measure", False):
        return "--measure runs the transformers path"
    engine = parse_params(getattr(args, "param", None)).get("engine", "auto")
    if engine == "reference":
        return "-p engine=reference runs the transformers path"
    if engine == "static":
        return None
    return "the CPU runs the transformers path" if chosen_device(args) == "cpu" else None


def chosen_device(args: argparse.Namespace) -> str:
    """``--device`` (``cpu``, ``cuda`` or ``cuda:N``), else cuda when there is one, else cpu; a device this machine
    does not have is refused in one line."""
    import torch

    wanted = getattr(args, "device", None)
    if not wanted:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(wanted)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {wanted!r}: use cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if device.type == "cuda" and torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        have = f"{count} CUDA device(s)" if count else "no CUDA device (or a torch built without CUDA)"
        raise ValueError(f"--device {wanted}: this machine has {have}; use --device cpu or leave --device out")
    return wanted


def check_device_map(args: argparse.Namespace, prog: str) -> None:
    """``--device-map`` with ``--device`` is refused in one line (``ValueError``); without a GPU it warns."""
    if not args.device_map:
        return
    if args.device:
        raise ValueError(f"--device-map {args.device_map} places the model itself; leave --device {args.device} out")
    check_placement(prog, args.device_map, None)


def chosen_dtype(args: argparse.Namespace, device: str) -> str:
    """``--dtype``, else bfloat16 on a GPU and float32 on the CPU."""
    return args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")


def load_placed(args: argparse.Namespace):
    """The model in ``--dtype`` (bf16 on a GPU, else fp32), on ``--device`` (default cuda when there is one) or
    where ``--device-map`` puts it; ``--rope-theta`` where the command has it."""
    import torch

    from rolecall.core.models import load_model

    device = chosen_device(args)
    dtype = chosen_dtype(args, device)
    model = load_model(args.model, dtype=getattr(torch, dtype), trust_remote_code=args.trust_remote_code,
                       rope_theta=getattr(args, "rope_theta", None), device_map=args.device_map)
    return model if args.device_map else model.to(device)


def eval_settings(args: argparse.Namespace):
    """The :class:`rolecall.eval.EvalSettings` the flags of :func:`add_prompt_arguments` ask for."""
    from rolecall.eval import EvalSettings

    return EvalSettings(lengths=tuple(args.lengths), depths=tuple(args.depths), samples_per_cell=args.samples_per_cell,
                        passkey_words=args.passkey_words, alphabet=args.alphabet, source=args.source,
                        prompts=args.prompts, max_new_tokens=args.max_new_tokens, suite=args.suite,
                        tasks=tuple(args.tasks or ()), seed=args.seed, data=args.data)


def check_placement(prog: str, device_map: str | None, deepspeed: str | None) -> None:
    """Where ``calibrate-delta`` and ``train-heads`` put the model, checked before anything loads: a ZeRO-3
    config (``--deepspeed``, or accelerate's) in a process no launcher started is refused in one line
    (``ValueError``; DeepSpeed would look for MPI instead), and ``--device-map`` on a machine without a GPU prints
    a one-line warning."""
    import torch

    from rolecall.core import distributed

    if not distributed.started_by_launcher() and distributed.zero_stage(distributed.deepspeed_config(deepspeed)) >= 3:
        raise ValueError(f"--deepspeed {deepspeed}: ZeRO-3 shards the model over the processes a launcher starts, "
                         "and this one was started alone; run it under `accelerate launch --config_file "
                         "configs/accelerate/zero3.yaml` or `torchrun`, or leave --deepspeed out")
    if device_map and not torch.cuda.is_available():
        print(f"{prog}: warning: --device-map {device_map} spreads a model over GPUs and this machine has none; on "
              "the CPU it only slows the run down, so leave --device-map out", file=sys.stderr)


def wall_time_line(command: str, total: float, times: dict[str, float]) -> str:
    """``<command>: wall time T s: load a s, generation b s, ...`` in the order the phases ran, and what the named
    phases leave out of the total (checks, plots, the report) as ``other``."""
    parts = [f"{name} {seconds:.1f} s" for name, seconds in times.items()]
    other = total - sum(times.values())
    return f"{command}: wall time {total:.1f} s: {', '.join(parts)}, other {max(other, 0.0):.1f} s"


def at_least(parser: argparse.ArgumentParser, args: argparse.Namespace, **lows: float | tuple[float, str]) -> None:
    """Each named flag's number (every item of a list; None is left alone) at least its low, given as ``steps=1``
    or with the reason as ``steps=(2, "why")``; else a usage error in one line naming the flag, the low, the
    reason and the value given."""
    for dest, low in lows.items():
        low, why = low if isinstance(low, tuple) else (low, "")
        value = getattr(args, dest)
        values = value if isinstance(value, list) else [value]
        if any(v is not None and v < low for v in values):
            parser.error(f"--{dest.replace('_', '-')} must be at least {low}{' each' if values is value else ''}"
                         f"{f' ({why})' if why else ''}, got {' '.join(map(str, values))}")
