"""The scheduler's decode step on the CPU against the context its rows reserve: does a step cost what the live
requests hold, or what they might?

    python -m benchmarks.cpu_step                          # the embedded SmolLM2, 10 short requests, 512 vs 8192

For each of ``--contexts`` it builds the scheduler of ``rolecall serve`` (``--slots`` rows of that many tokens,
full attention, float32 on the CPU), runs ``--requests`` short requests at once (``--prompt-tokens`` ids each,
``--new-tokens`` new ones, ignoring EOS), and reads the engine's own time in decode steps over the steps it ran
(``Scheduler.stats``); the first ``--warmup`` requests are a warm-up, not counted. It prints a table and writes
JSON (``--out``, default ``benchmarks/results/cpu_step_<model>.json``) with the host CPU and the thread count;
``× first`` is each context's step over the first context's.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch

from rolecall.cli.command import Parser


def run_load(scheduler: Any, requests: int, prompt: int, new: int) -> None:
    from rolecall.runtime.engine.scheduler import Request

    if requests == 0:
        return
    done, lock, count = threading.Event(), threading.Lock(), [0]

    def emit(event: Any) -> None:
        if event.finish_reason is not None:
            if event.finish_reason == "error":
                raise SystemExit(f"a request failed: {event.error}")
            with lock:
                count[0] += 1
                if count[0] == requests:
                    done.set()

    for i in range(requests):
        ids = tuple(100 + (7 * i + 13 * j) % 5000 for j in range(prompt))
        scheduler.submit(Request(ids, max_new_tokens=new, ignore_eos=True), emit)
    done.wait()


def step_ms(weights: Any, policy: Any, context: int, args: Any) -> dict[str, Any]:
    from rolecall.runtime.engine.scheduler import Scheduler

    with Scheduler(weights, policy, slots=args.slots, max_context=context) as scheduler:
        run_load(scheduler, args.warmup, args.prompt_tokens, args.new_tokens)
        before = scheduler.stats()
        run_load(scheduler, args.requests, args.prompt_tokens, args.new_tokens)
        after = scheduler.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    seconds = after["decode_seconds"] - before["decode_seconds"]
    return {"context": context, "steps": steps, "step_ms": 1e3 * seconds / max(steps, 1),
            "kv_bytes": after["kv_bytes"]}


def parse_args(argv: list[str] | None = None) -> Any:
    """The flags, checked (a usage error in one line before any work)."""
    p = Parser(prog="cpu_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", default="512,8192", help="comma-separated --max-context values")
    p.add_argument("--slots", type=int, default=10)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.contexts = p.counts(args.contexts, "--contexts", "token counts", low=64)
    for flag in ("slots", "requests", "prompt_tokens", "new_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.prompt_tokens + args.new_tokens > min(args.contexts):
        p.error(f"--prompt-tokens + --new-tokens ({args.prompt_tokens + args.new_tokens}) must fit the smallest "
                f"context ({min(args.contexts)})")
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.report import host_cpu
    from rolecall.core.models import load_model
    from rolecall.runtime.engine import Weights
    from rolecall.runtime.session import bound_policy

    args = parse_args(argv)
    contexts = args.contexts
    model = load_model(args.model, dtype=torch.float32)
    weights = Weights.from_model(model, positions=max(contexts))
    policy = bound_policy("full", None, model.config)
    print(f"{host_cpu()}, {torch.get_num_threads()} threads; {args.model} float32; {args.requests} requests of "
          f"{args.prompt_tokens} + {args.new_tokens} tokens in {args.slots} slots")
    print(f"{'context':>8} {'step ms':>8} {'× first':>8} {'KV MiB':>8}")
    rows = []
    for context in contexts:
        rows.append(step_ms(weights, policy, context, args))
        rows[-1]["vs_first"] = rows[-1]["step_ms"] / rows[0]["step_ms"]
        r = rows[-1]
        print(f"{context:>8} {r['step_ms']:>8.1f} {r['vs_first']:>8.2f} {r['kv_bytes'] / 2**20:>8.1f}")
    out = Path(args.out or f"benchmarks/results/cpu_step_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host_cpu": host_cpu(), "threads": torch.get_num_threads(),
                               "settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
