"""The memory plan against the GPU: does a model served with ``rolecall serve``'s defaults fit, and how close is
the plan's estimate to what the engine holds?

    python -m benchmarks.plan_fit --models qwen-14b,qwen-7b --requests 8

For each alias (its bundled config, random bf16 weights: memory depends on shapes alone) it computes the plan
that ``rolecall serve`` logs and the rows and KV pool serve takes from it (``cli.serve.planned_slots``:
``--gpu-memory-utilization``, default 0.9, of this GPU; ``--max-context``, default the model's context; the default
slots; ``--no-paged-kv``: a contiguous cache, each row its whole context, as serve had before KV was paged), builds
the weights and the scheduler so, submits ``--requests`` requests of ``--prompt-tokens`` and ``--output-tokens``
token ids (``LOW:HIGH`` uniform, ``--seed``) at once, more of them than there are rows, and reads back: requests
finished and failed, output tokens a second over the run, preemptions, the weights and the KV cache as allocated,
and the peak the allocator reserved. ``activation`` is the peak beyond the weights and the cache, against the
plan's estimate; ``fits`` says whether the peak stayed within ``utilization × device``. The GPU is named in the
table and the JSON (``--out``, default ``benchmarks/results/plan_fit_<gpu>.json``).
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
    from rolecall.cli import build_parser
    from rolecall.cli.serve import planned_slots
    from rolecall.core.models import context_limit, load_config
    from rolecall.runtime.engine import ModelShape, Weights
    from rolecall.runtime.engine.scheduler import Scheduler
    from rolecall.runtime.memory import device_memory
    from rolecall.runtime.session import bound_policy

    config = load_config(alias)
    policy = bound_policy("full", None, config)
    context = args.max_context or context_limit(config, alias)
    size, name = device_memory("cuda")
    flags = build_parser().parse_args(["serve", "--model", alias, "--random-weights", "--dtype", "bfloat16",
                                       "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                                       *([] if args.paged_kv else ["--no-paged-kv"])])
    row: dict[str, Any] = {"model": alias, "context": context, "paged": args.paged_kv}
    try:
        slots, plan, kv_pages = planned_slots(flags, config, policy, "cuda", context)
    except ValueError as e:
        return {**row, "refused": str(e)}
    row["plan"] = plan.as_json()
    gc.collect()  # the last model's scheduler (a reference cycle through its thread) and its cache, gone
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    weights = Weights.random(ModelShape.from_config(config), "cuda", torch.bfloat16, positions=context)
    held_weights = torch.cuda.memory_allocated() - base
    start = time.perf_counter()
    with Scheduler(weights, policy, slots=slots, max_context=context, eos_token_id=None, kv_pages=kv_pages,
                   paged=kv_pages is not None) as scheduler:
        finished, failed = run_load(scheduler, args)
        stats = scheduler.stats()
    seconds = time.perf_counter() - start
    kv = stats["kv_bytes"]
    peak = torch.cuda.max_memory_reserved()
    activation = peak - base - held_weights - kv
    made = sum(e.completion_tokens for e in finished)
    return {**row, "slots": slots, "kv_pages": kv_pages, "requests": args.requests, "failed": len(failed),
            "errors": failed[:3], "seconds": seconds, "output_tokens": made, "output_tokens_per_s": made / seconds,
            "preemptions": stats["preemptions"], "kv_pages_used_after": stats["kv_pages_used"],
            "weight_bytes": held_weights, "kv_bytes": kv, "peak_reserved_bytes": peak,
            "activation_bytes": activation, "fits": peak <= plan.utilization * size,
            "held_before_bytes": base, "device": name, "device_bytes": size}


def run_load(scheduler: Any, args: argparse.Namespace) -> tuple[list[Any], list[str]]:
    """``--requests`` requests of random token ids submitted at once, all waited for: their last events, and the
    errors of those that failed."""
    from rolecall.runtime.engine.scheduler import Request

    rng = np.random.default_rng(args.seed)
    prompts = [args.prompt_tokens.draw(rng) for _ in range(args.requests)]
    answers = [args.output_tokens.draw(rng) for _ in range(args.requests)]
    done, failed, lock, finished = threading.Event(), [], threading.Lock(), []

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
    return finished, failed


def print_row(r: dict[str, Any]) -> None:
    p = r["plan"]
    if "refused" in r:
        print(f"{r['model']:<10} refused: {r['refused']}")
        return
    kv_plan = p["pool_bytes"] if r["paged"] else r["slots"] * p["request_bytes"]
    print(f"{r['model']:<10} {'paged' if r['paged'] else 'contig':>6} {r['context']:>8,} {r['slots']:>5} "
          f"{r['requests'] - r['failed']:>4}/{r['requests']:<4} {r['output_tokens_per_s']:>7.1f} {r['preemptions']:>5} "
          f"{p['weight_bytes'] / GIB:>6.2f}/{r['weight_bytes'] / GIB:<6.2f} "
          f"{p['activation_bytes'] / GIB:>6.2f}/{r['activation_bytes'] / GIB:<6.2f} "
          f"{kv_plan / GIB:>6.2f}/{r['kv_bytes'] / GIB:<6.2f} "
          f"{r['peak_reserved_bytes'] / GIB:>7.2f} {str(r['fits']):>5}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (a usage error in one line before any work)."""
    from rolecall.core.models import list_aliases

    p = Parser(prog="plan_fit.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen-14b,qwen-7b", help="comma-separated aliases")
    p.add_argument("--max-context", type=int, default=None, help="tokens a request may hold [the model's context]")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-paged-kv", dest="paged_kv", action="store_false",
                   help="serve's --no-paged-kv: a contiguous cache, each row its whole context")
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
    print(f"{'model':<10} {'KV':>6} {'context':>8} {'slots':>5} {'done':>9} {'tok/s':>7} {'pre.':>5} {'weights':>13} "
          f"{'activation':>13} {'KV pool':>13} {'peak':>7} {'fits':>5}")
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
