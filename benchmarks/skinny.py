"""Decode-step projections on a GPU: cuBLAS (``F.linear``) against the Triton skinny matmul, as bandwidth.

    python benchmarks/skinny.py --out benchmarks/results/skinny_<gpu>.json

For the DS-Qwen-7B projection shapes (q/k/v stacked, o, gate/up stacked, down, lm_head) at 1, 8, 16 and 64
rows: median time (CUDA events, L2 flushed by rotating over copies of the weight), bytes read over time as a
fraction of the measured copy bandwidth, and the largest deviation from cuBLAS relative to its largest value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import copy_bandwidth, event_times, gpu_slug  # noqa: E402
from runtime.atomic import write_text  # noqa: E402
from runtime.kernels.skinny_matmul import triton as skinny  # noqa: E402

SHAPES_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944),
             "lm_head": (152064, 3584)}


def graphed_ms(fn, x, ws, reps: int) -> float:
    """Median ms of one call, from a CUDA graph that calls ``fn`` once on each weight copy (so no launch
    overhead is counted and each call reads its weight from memory, not L2)."""
    for w in ws:  # warm-up: compiles and autotunes outside the capture
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            fn(x, w)
    return statistics.median(event_times(graph.replay, reps=reps, warmup=3)) / len(ws)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,8,16,64")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth("cuda", 2**30)
    print(f"{gpu}; copy {bw / 1e12:.2f} TB/s")
    rows_out = []
    for name, (n, k) in SHAPES_7B.items():
        copies = max(4, (1 << 30) // (n * k * 2) + 1)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, ws[0])
            got = skinny.skinny_linear(x, ws[0])
            err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            t_cublas = graphed_ms(F.linear, x, ws, args.reps)
            t_triton = graphed_ms(skinny.skinny_linear, x, ws, args.reps)
            nbytes = n * k * 2 + m * k * 2 + m * n * 2
            r = {"shape": name, "n": n, "k": k, "rows": m, "cublas_ms": t_cublas, "triton_ms": t_triton,
                 "cublas_of_copy": nbytes / (t_cublas / 1e3) / bw, "triton_of_copy": nbytes / (t_triton / 1e3) / bw,
                 "rel_err": err}
            rows_out.append(r)
            print(f"{name:>8} M={m:>3}: cuBLAS {t_cublas:.4f} ms ({100 * r['cublas_of_copy']:.0f} %), Triton "
                  f"{t_triton:.4f} ms ({100 * r['triton_of_copy']:.0f} %), rel err {err:.1e}", flush=True)
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"skinny_{gpu_slug(gpu)}.json")
    write_text(out, json.dumps({"gpu": gpu, "copy_bandwidth_Bps": bw, "rows": rows_out}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
