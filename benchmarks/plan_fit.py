"""The memory plan against the GPU: does a model served with ``rolecall serve``'s defaults fit, and how close is
the plan's estimate to what the engine holds?

    python -m benchmarks.plan_fit --models qwen-14b,qwen-7b --requests 8

For each alias (its bundled config, random bf16 weights: memory depends on shapes alone) it computes the plan
that ``rolecall serve`` logs (``--gpu-memory-utilization``, default 0.9, of this GPU; ``--max-context``, default
the model's context), builds the weights and the scheduler with the rows the plan allows, runs ``--requests``
requests of ``--prompt-tokens`` and ``--output-tokens`` token ids (``LOW:HIGH`` uniform, ``--seed``) through it,
more of them than there are rows, and reads back: requests finished and failed, the weights and the KV cache as
allocated, and the peak the allocator reserved. ``activation`` is the peak beyond the weights and the cache,
against the plan's estimate; ``fits`` says whether the peak stayed within ``utilization × device``. The GPU is
named in the table and the JSON (``--out``, default ``benchmarks/results/plan_fit_<gpu>.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.load import Lengths
from rolecall.cli.command import Parser

GIB = 2 ** 30


def measure(alias: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model: the plan, then the engine under the plan's rows, with the allocator's figures."""
    from rolecall.cli.plan import plan_for
    from rolecall.cli.serve import SLOTS
    from rolecall.core.models import context_limit, load_config
    from rolecall.runtime.engine import ModelShape, Weights
    from rolecall.runtime.engine.scheduler import Request, Scheduler
    from rolecall.runtime.memory import device_memory
    from rolecall.runtime.session import bound_policy

    config = load_config(alias)
    policy = bound_policy("full", None, config)
    context = args.max_context or context_limit(config, alias)
    size, name = device_memory("cuda")
    flags = argparse.Namespace(model=alias, policy="full", gpu_memory_utilization=args.gpu_memory_utilization,
                               kv_cache_gib=None)
    plan = plan_for(flags, config, policy, context=context, dtype="bfloat16", device=name, device_bytes=size,
                    rows=SLOTS["cuda"])
    row: dict[str, Any] = {"model": alias, "context": context, "plan": plan.as_json()}
    if plan.refusal():
        return {**row, "refused": plan.refusal()}
    slots = min(SLOTS["cuda"], plan.max_concurrency)
    gc.collect()  # the last model's scheduler (a reference cycle through its thread) and its cache, gone
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    weights = Weights.random(ModelShape.from_config(config), "cuda", torch.bfloat16, positions=context)
    held_weights = torch.cuda.memory_allocated() - base
    rng = np.random.default_rng(args.seed)
    prompts = [args.prompt_tokens.draw(rng) for _ in range(args.requests)]
    answers = [args.output_tokens.draw(rng) for _ in range(args.requests)]
    done, failed, lock, finished = threading.Event(), [], threading.Lock(), []
    start = time.perf_counter()
    with Scheduler(weights, policy, slots=slots, max_context=context, eos_token_id=None) as scheduler:
        def emit(event: Any) -> None:
            if event.finish_reason is None:
                return
            with lock:
                finished.append(event)
                if event.finish_reason == "error":
                    failed.append(event.error)
                if len(finished) == args.requests:
                    done.set()

        for p, a in zip(prompts, answers):
            ids = rng.integers(100, 30000, size=p).tolist()
            scheduler.submit(Request(tuple(ids), max_new_tokens=a, ignore_eos=True), emit)
        done.wait()
        kv = scheduler.stats()["kv_bytes"]
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_reserved()
    activation = peak - base - held_weights - kv
    return {**row, "slots": slots, "requests": args.requests, "failed": len(failed), "errors": failed[:3],
            "seconds": seconds, "weight_bytes": held_weights, "kv_bytes": kv, "peak_reserved_bytes": peak,
            "activation_bytes": activation, "fits": peak <= plan.utilization * size,
            "held_before_bytes": base, "device": name, "device_bytes": size}


def print_row(r: dict[str, Any]) -> None:
    p = r["plan"]
    if "refused" in r:
        print(f"{r['model']:<10} refused: {r['refused']}")
        return
    print(f"{r['model']:<10} {r['context']:>8,} {r['slots']:>5} {r['requests'] - r['failed']:>4}/{r['requests']:<4} "
          f"{p['weight_bytes'] / GIB:>6.2f}/{r['weight_bytes'] / GIB:<6.2f} "
          f"{p['activation_bytes'] / GIB:>6.2f}/{r['activation_bytes'] / GIB:<6.2f} "
          f"{r['slots'] * p['request_bytes'] / GIB:>6.2f}/{r['kv_bytes'] / GIB:<6.2f} "
          f"{r['peak_reserved_bytes'] / GIB:>7.2f} {str(r['fits']):>5}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (a usage error in one line before any work)."""
    from rolecall.core.models import list_aliases

    p = Parser(prog="plan_fit.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen-14b,qwen-7b", help="comma-separated aliases")
    p.add_argument("--max-context", type=int, default=None, help="tokens a request may hold [the model's context]")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", default="1024:8192", help="N, or LOW:HIGH drawn uniformly")
    p.add_argument("--output-tokens", default="64:256", help="N, or LOW:HIGH drawn uniformly")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    p.names(args.models, "--models", list_aliases())
    if args.requests < 1:
        p.error(f"--requests must be at least 1, got {args.requests}")
    try:
        args.prompt_tokens = Lengths.parse(args.prompt_tokens, "--prompt-tokens")
        args.output_tokens = Lengths.parse(args.output_tokens, "--output-tokens")
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("plan_fit.py: error: needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}; plan/measured in GiB")
    print(f"{'model':<10} {'context':>8} {'slots':>5} {'done':>9} {'weights':>13} {'activation':>13} {'KV':>13} "
          f"{'peak':>7} {'fits':>5}")
    rows = []
    for alias in args.models.split(","):
        rows.append(measure(alias, args))
        print_row(rows[-1])
    out = Path(args.out or f"benchmarks/results/plan_fit_{gpu.replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Lengths) else v) for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"gpu": gpu, "settings": settings,
                               "rows": rows}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
