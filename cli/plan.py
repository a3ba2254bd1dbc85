"""``rolecall plan``: how a model would be served on a device, from its config alone (no GPU, no weights): the
weights, the activation peak, the KV pool in pages, KV bytes a token under a policy and the maximum concurrency
at ``--max-context``. ``rolecall serve`` computes the same plan (:func:`plan_for`), logs it at start and refuses a
setting that cannot hold one request before any weight loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rolecall.cli.common import add_manifest, add_model, policy_inputs
from rolecall.runtime.memory import ELEMENT_BYTES

H100_GIB = 79.2  # what torch reports of an 80 GB H100: the default device when this machine has no GPU


def add_memory(parser: argparse.ArgumentParser) -> None:
    """``--gpu-memory-utilization`` and ``--kv-cache-gib``, shared by ``plan`` and ``serve``."""
    from rolecall.runtime.memory import DEFAULT_UTILIZATION

    parser.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_UTILIZATION, metavar="F",
                        help="fraction of the device's memory for weights, activations and the KV pool, in (0, 1] "
                        f"(default {DEFAULT_UTILIZATION}; on the CPU, of the machine's RAM)")
    parser.add_argument("--kv-cache-gib", type=float, default=None, metavar="G", help="the KV pool's size in GiB, "
                        "instead of what --gpu-memory-utilization leaves")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser)
    add_manifest(parser, "role manifest (.safetensors): lethe's layers.budget sets what each layer holds")
    parser.add_argument("--policy", default=None, help="full, delta, lychee, lethe, vattention or quest (default: the "
                        "manifest's recommended setting, else delta with a manifest, else full)")
    parser.add_argument("--param", "-p", action="append", metavar="NAME=VALUE",
                        help="policy parameter, repeatable (-p sparse_ratio=0.25 or -p budget=1024 for lethe)")
    parser.add_argument("--max-context", type=int, default=None, metavar="N", help="tokens (prompt + answer) of one "
                        "request [the model's context]")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, metavar="G", help="the device's memory in GiB "
                        f"[this machine's GPU; else {H100_GIB}, an 80 GB H100]")
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(ELEMENT_BYTES), help="weights and KV dtype (default "
                        "bfloat16)")
    parser.add_argument("--slots", type=int, default=1, metavar="N", help="rows decoded together (their logits count "
                        "in the activations; default 1)")
    add_memory(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def check_memory_flags(args: argparse.Namespace) -> None:
    """The memory flags, refused in one line (``ValueError``) before anything loads."""
    from rolecall.runtime.memory import check_fraction, check_gib

    check_fraction(args.gpu_memory_utilization)
    if args.kv_cache_gib is not None:
        check_gib(args.kv_cache_gib, "--kv-cache-gib")
    if getattr(args, "gpu_memory_gib", None) is not None:
        check_gib(args.gpu_memory_gib, "--gpu-memory-gib")


def plan_for(args: argparse.Namespace, config: Any, policy: Any, *, context: int, dtype: str, device: str,
             device_bytes: int, rows: int, whole_rows: bool = False) -> Any:
    """The :class:`~rolecall.runtime.memory.MemoryPlan` of serving ``config`` with a bound ``policy`` at
    ``context`` tokens a request, from the memory flags in ``args``. ``whole_rows``: every row holds its whole
    context in every layer, whatever the policy evicts (the served engine's rows: an evicting policy's kept tokens
    sit in a row of the full context until the KV is held by the page)."""
    from rolecall.runtime.engine.prefill import chunk_for
    from rolecall.runtime.engine.shape import ModelShape
    from rolecall.runtime.memory import GIB, plan_memory
    from rolecall.runtime.policies.base import tokens_held

    shape = ModelShape.from_config(config)
    kv = None if args.kv_cache_gib is None else int(args.kv_cache_gib * GIB)
    return plan_memory(shape, max_context=context, element=ELEMENT_BYTES[dtype], device_bytes=device_bytes,
                       cuda=device != "cpu", held=None if whole_rows else tokens_held(policy, shape.layers, context),
                       utilization=args.gpu_memory_utilization, kv_cache_bytes=kv, rows=rows, chunk=chunk_for(1),
                       model=args.model, policy=policy.name, device=device, dtype=dtype)


def run(args: argparse.Namespace) -> int:
    from rolecall.cli.serve import context_of
    from rolecall.core.models import load_config
    from rolecall.runtime.session import bound_policy

    check_memory_flags(args)
    if args.slots < 1:
        raise ValueError(f"--slots {args.slots}: plan for at least 1 row")
    config = load_config(args.model, trust_remote_code=args.trust_remote_code)
    if args.policy is None and args.manifest is None:
        args.policy = "full"
    params, manifest = policy_inputs(args, config)
    params.pop("min_context", None)
    policy = bound_policy(args.policy, manifest, config, **params)
    args.allow_long_context = False
    context = context_of(args, config)
    device, device_bytes = local_device(args)
    plan = plan_for(args, config, policy, context=context, dtype=args.dtype, device=device,
                    device_bytes=device_bytes, rows=args.slots)
    if args.json:
        print(json.dumps(plan.as_json(), sort_keys=True))
    else:
        print("\n".join(plan.lines()))
    why = plan.refusal()
    if why:
        print(f"rolecall plan: error: {why}", file=sys.stderr)
        return 2
    return 0


def local_device(args: argparse.Namespace) -> tuple[str, int]:
    """The device to plan for, named, and its bytes: ``--gpu-memory-gib``, else this machine's first GPU, else an
    80 GB H100 as torch reports it."""
    from rolecall.runtime.memory import GIB

    if args.gpu_memory_gib is not None:
        return f"a device of {args.gpu_memory_gib:g} GiB", int(args.gpu_memory_gib * GIB)
    import torch

    if torch.cuda.is_available():
        from rolecall.runtime.memory import device_memory

        size, name = device_memory("cuda")
        return f"{name} ({size / GIB:.1f} GiB)", size
    return f"an 80 GB H100 ({H100_GIB} GiB; --gpu-memory-gib to change)", int(H100_GIB * GIB)
