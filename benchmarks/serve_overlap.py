"""A prefill beside the scheduler's decode steps: would a second stream or a share of the SMs hide it?

    python -m benchmarks.serve_overlap            # DS-Qwen-7B shape, random bf16 weights, one CUDA GPU

Under load, each admitted request's prefill runs between two runs of decode steps, and every live row waits for it
(``docs/serving.md``). This asks whether running it beside the steps would hide that wait. The scheduler's decoder
of 64 rows of 12K to 32K tokens (:func:`benchmarks.serve_step.rows_decoder`) steps while one prompt (16,384 tokens
by default) is prefilled into a one-row decoder of its own, in the ways a runtime could place it:

* ``serial``: on the steps' own stream, as the scheduler runs it (the steps wait);
* ``priority``: on a stream of low priority, the steps on one of high priority; ``priority, chunks``: the same in
  chunks of 2,048 tokens;
* ``green N``: on a stream of a CUDA green context of N SMs (``torch.cuda.green_contexts``, where torch has it), the
  steps on a stream of high priority.

The host enqueues the whole prefill, then steps (at most two queued) until the prefill's end event has passed. Per
way: the prefill's time, the steps that began while it ran and their mean time over the step's alone, and what the
overlap saved: ``1 − wall / (prefill alone + steps × step alone)``. JSON (``--out``, default
``benchmarks/results/serve_overlap_<gpu>.json``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from benchmarks.decode import make_policy
from benchmarks.report import host_cpu
from benchmarks.serve_step import BUDGET, POLICIES, RETRIEVAL_HEADS, rows_decoder
from benchmarks.timing import event_times, gpu_slug
from rolecall.cli import Parser
from rolecall.core.atomic import write_text
from rolecall.runtime.engine import SHAPES, StaticDecoder, Weights
from rolecall.runtime.engine.sampling import Sampler, Sampling

ROOT = Path(__file__).resolve().parents[1]
ROWS, SLOTS, CHUNK = 64, 32768, 2048
GREEN_SMS = (16, 32, 48, 66)


def ways() -> tuple[list[tuple[str, Any, Any, int | None]], list[Any]]:
    """(label, the prefill's stream, the steps' stream, chunk) per way, and the green contexts to keep alive."""
    low, high, same = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-2), torch.cuda.Stream()
    out = [("serial", same, same, None), ("priority", low, high, None), (f"priority, chunks of {CHUNK}", low, high, CHUNK)]
    contexts = []
    green = getattr(getattr(torch.cuda, "green_contexts", None), "GreenContext", None)
    for n in GREEN_SMS if green is not None else ():
        try:
            ctx = green.create(num_sms=n, device_id=torch.cuda.current_device())
            out.append((f"green {n}", ctx.Stream(), high, None))
            contexts.append(ctx)
        except (RuntimeError, TypeError, AttributeError) as e:  # an older torch or driver: that way is left out
            print(f"green context of {n} SMs: {type(e).__name__}: {e}", file=sys.stderr)
    return out, contexts


def beside(dec: StaticDecoder, lengths: torch.Tensor, pre: StaticDecoder, ids: torch.Tensor, prefill_stream: Any,
           step_stream: Any, chunk: int | None) -> dict[str, Any]:
    """One prefill of ``ids`` by ``pre`` on ``prefill_stream`` while ``dec`` steps on ``step_stream`` until it ends."""
    dec.cache.length.copy_(lengths.to(ids.device))  # the same contexts for every way
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    with torch.cuda.stream(prefill_stream):
        begin.record()
        pre.reset()
        pre.prefill(ids, chunk=chunk)
        end.record()
    enqueue = time.perf_counter() - start
    marks = []
    with torch.cuda.stream(step_stream):
        while len(marks) < 3 or not end.query():
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
            dec.step()
            if len(marks) > 2:
                marks[-3].synchronize()  # at most two steps queued
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3
    steps = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    prefill_ms = begin.elapsed_time(end)
    during = [ms for mark, ms in zip(marks, steps) if begin.elapsed_time(mark) < prefill_ms]
    return {"wall_ms": wall, "enqueue_ms": enqueue * 1e3, "prefill_ms": prefill_ms, "steps": len(steps),
            "steps_during": len(during), "step_ms_during": statistics.mean(during) if during else None}


def measure(weights: Weights, name: str, lengths: torch.Tensor, prompt: int) -> dict[str, Any]:
    """Every way for policy ``name``: the step and the prefill alone, then each way twice (the second kept)."""
    policy = make_policy(name, SHAPES["7b"], BUDGET, RETRIEVAL_HEADS)
    dec = rows_decoder(weights, policy, lengths, SLOTS)
    pre = StaticDecoder(weights, policy, 1, SLOTS, min_context=0, sampler=Sampler(Sampling(), weights.device),
                        compile=False)
    ids = torch.randint(0, SHAPES["7b"].vocab, (1, prompt), generator=torch.Generator().manual_seed(1)).cuda()
    step = statistics.median(event_times(dec.step, reps=30, warmup=5))
    alone = {}
    for chunk in (None, CHUNK):
        alone[chunk] = statistics.median(event_times(lambda c=chunk: (pre.reset(), pre.prefill(ids, chunk=c)),
                                                     reps=3, warmup=1))
    row = {"policy": name, "step_ms": step, "prefill_ms": alone[None], f"prefill_ms_chunks_{CHUNK}": alone[CHUNK],
           "ways": {}}
    listed, _contexts = ways()
    for label, prefill_stream, step_stream, chunk in listed:
        beside(dec, lengths, pre, ids, prefill_stream, step_stream, chunk)  # warm-up
        r = beside(dec, lengths, pre, ids, prefill_stream, step_stream, chunk)
        r["serial_ms"] = alone[chunk] + r["steps"] * step
        r["saved"] = 1 - r["wall_ms"] / r["serial_ms"]
        r["step_during_over_alone"] = r["step_ms_during"] / step if r["step_ms_during"] else None
        row["ways"][label] = r
        print(f"{name:>7} {label:>22} {alone[chunk]:9.1f} {r['prefill_ms']:9.1f} {r['steps_during']:6d} "
              f"{r['step_during_over_alone'] or 0:8.2f} {r['saved']:7.1%}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog=Path(__file__).name, description=__doc__.split("\n")[0])
    p.add_argument("--policies", default="delta,full", help="comma-separated (default delta,full)")
    p.add_argument("--prompt", type=int, default=16384, help="the prefilled prompt's tokens (default 16384)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve_overlap_<gpu>.json)")
    args = p.parse_args(argv)
    p.check_writable(args.out, "--out")
    names = [n for n in args.policies.split(",") if n]
    if not names or any(n not in POLICIES for n in names):
        p.error(f"--policies takes comma-separated names of {', '.join(POLICIES)}, got {args.policies!r}")
    if not 1 <= args.prompt < SLOTS:
        p.error(f"--prompt must be 1 to {SLOTS - 1} (the prefill's decoder holds {SLOTS} slots), got {args.prompt}")
    if not torch.cuda.is_available():
        print("benchmarks/serve_overlap.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    weights = Weights.random(SHAPES["7b"], torch.device("cuda"), torch.bfloat16)
    lengths = torch.randint(12288, SLOTS - 1024, (ROWS,), generator=torch.Generator().manual_seed(0))
    print(f"{gpu}; 7b shape, bf16; {ROWS} rows of 12K-31K tokens (mean {int(lengths.float().mean())}) stepping beside "
          f"a prefill of {args.prompt} tokens", flush=True)
    print(f"{'policy':>7} {'way':>22} {'alone ms':>9} {'beside ms':>9} {'steps':>6} {'step ×':>8} {'saved':>7}")
    rows = []
    for name in names:
        rows.append(measure(weights, name, lengths, args.prompt))
        torch.cuda.empty_cache()
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"serve_overlap_{gpu_slug(gpu)}.json")
    report = {"gpu": gpu, "sms": torch.cuda.get_device_properties(0).multi_processor_count, "host_cpu": host_cpu(),
              "torch": torch.__version__, "shape": "7b", "dtype": "bfloat16", "rows": ROWS, "slots": SLOTS,
              "mean_context": int(lengths.float().mean()), "prompt": args.prompt, "budget": BUDGET,
              "retrieval_heads": RETRIEVAL_HEADS, "policies": rows}
    write_text(out, json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
