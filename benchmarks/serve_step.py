"""The scheduler's decode step against the benchmark's static step, without the server around it.

    python -m benchmarks.serve_step            # DS-Qwen-7B shape, random bf16 weights, one CUDA GPU

Two questions a serving TPOT raises, answered by CUDA-graph replays (medians of 30, warm-up excluded):

* **Rows of their own lengths.** 64 rows whose contexts are drawn uniformly from 12K to 32K tokens, in a cache of
  32,768 slots a row (what ``rolecall serve --slots 64 --max-context 32768`` holds), stepped as the scheduler steps
  them (``row_lengths``, its sampler and stopper), against the static step of 64 rows all at the mean context in a
  cache of that size: ``rows / static``.
* **A cache larger than the context.** The static step of 8 rows at 32K tokens in caches of 32K + a margin, 40,960
  (what ``session.generate`` keeps for the next request) and 65,536 slots.

For ``full``, ``delta`` and ``lychee`` (2K budget; delta's and lychee's roles as ``benchmarks/decode.py`` makes
them). JSON (``--out``, default ``benchmarks/results/serve_step_<gpu>.json``): the GPU, and per policy both
comparisons.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from benchmarks.decode import Bench, make_policy
from benchmarks.report import host_cpu
from benchmarks.timing import event_times, gpu_slug
from rolecall.cli import Parser
from rolecall.core.atomic import write_text
from rolecall.runtime.engine import SHAPES, StaticDecoder, Weights
from rolecall.runtime.engine.batcher import RowStopper
from rolecall.runtime.engine.sampling import RowSampler

ROOT = Path(__file__).resolve().parents[1]

POLICIES = ("full", "delta", "lychee")
BUDGET, RETRIEVAL_HEADS = 2048, 32


def rows_decoder(weights: Weights, policy, lengths: torch.Tensor, slots: int) -> StaticDecoder:
    """The scheduler's decoder over rows at ``lengths`` in ``slots``-slot rows (random K/V, every row decoding,
    no limit), captured."""
    b = len(lengths)
    stopper, sampler = RowStopper(b, 1, 0, weights.device), RowSampler(b, weights.device)
    dec = StaticDecoder(weights, policy, b, slots, min_context=0, sampler=sampler, stopper=stopper, row_lengths=True)
    dec.cache.fill_random()
    dec.cache.length.copy_(lengths.to(weights.device))
    for row in range(b):
        stopper.set_row(row, 1 << 30, [], 1)
    dec.position = int(lengths.max())
    dec.capture()
    return dec


def rows_step_ms(weights: Weights, policy, lengths: torch.Tensor, slots: int) -> float:
    """Median ms of the scheduler's step over rows at ``lengths`` in ``slots``-slot rows (every row decoding)."""
    return statistics.median(event_times(rows_decoder(weights, policy, lengths, slots).step, reps=30, warmup=5))


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog=Path(__file__).name, description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve_step_<gpu>.json)")
    args = p.parse_args(argv)
    p.check_writable(args.out, "--out")
    if not torch.cuda.is_available():
        print("benchmarks/serve_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu, shape = torch.cuda.get_device_name(), SHAPES["7b"]
    bench = Bench.with_defaults("cuda", 4.2e12)
    weights = Weights.random(shape, torch.device("cuda"), torch.bfloat16)
    lengths = torch.randint(12288, 32768 - 64, (64,), generator=torch.Generator().manual_seed(0))
    mean = int(lengths.float().mean())
    rows, slots_rows = [], []
    print(f"{gpu}; 7b shape, bf16; 64 rows of 12K-32K tokens (mean {mean}) in 32768-slot rows", flush=True)
    print(f"{'policy':>8} {'rows ms':>9} {'static ms':>9} {'ratio':>7}   8x32K in 32K+ / 40960 / 65536 slots (ms)")
    for name in POLICIES:
        policy = make_policy(name, shape, BUDGET, RETRIEVAL_HEADS)
        r = rows_step_ms(weights, policy, lengths, 32768)
        torch.cuda.empty_cache()
        s = bench.measure_random(weights, policy, 64, mean + bench.margin(), mean, name)
        by_slots = {slots: bench.measure_random(weights, policy, 8, slots, 32768, name)
                    for slots in (32768 + bench.margin(), 40960, 65536)}
        torch.cuda.empty_cache()
        rows.append({"policy": name, "rows_ms": r, "static_ms": s, "rows_over_static": r / s, "mean_context": mean})
        slots_rows.append({"policy": name, "batch": 8, "context": 32768,
                           "ms_by_slots": {str(k): v for k, v in by_slots.items()}})
        print(f"{name:>8} {r:9.2f} {s:9.2f} {r / s:7.3f}   " + " / ".join(f"{v:.3f}" for v in by_slots.values()),
              flush=True)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"serve_step_{gpu_slug(gpu)}.json")
    report = {"gpu": gpu, "host_cpu": host_cpu(), "torch": torch.__version__, "shape": "7b", "dtype": "bfloat16",
              "budget": BUDGET, "retrieval_heads": RETRIEVAL_HEADS, "row_lengths": rows, "cache_size": slots_rows}
    write_text(out, json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
