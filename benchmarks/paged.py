"""Paged against contiguous KV on one GPU: the decode-attention kernel and the new token's store, reading the same
tokens, timed in the same run.

    python -m benchmarks.paged                  # DS-R1-Distill-Qwen-7B heads, 32K x 8 and 128K x 1, bf16

For each ``--cases`` entry (``tokens x rows``) it fills a contiguous cache ``[rows, Hkv, tokens, D]`` with random
keys and values and the same tokens into a pool of 16-token pages in shuffled order (the worst case for locality:
no two neighbouring pages of a row are neighbours in memory), read through a block table. It times each call as a
decode step runs it, inside a CUDA graph of 16 calls (the median of ``--reps`` replays, over 16, after a warm-up):

* ``dense``: every token of every row (full attention, a Δ-layer's read);
* ``keep-logits``: the same, keeping the logits a selection layer scores pages from;
* ``pages``: ``--budget`` tokens of 16-token pages a KV head (DELTA's and Quest's sparse layers);
* ``store``: the new token's RoPE and its K/V written at each row's own slot.

It checks that both layouts give the same output (``max_abs_diff``), prints a table and writes JSON (``--out``,
default ``benchmarks/results/paged_<gpu>.json``) naming the GPU. ``paged / contiguous`` is the paged call's time
over the contiguous one's.

    python -m benchmarks.paged --steps          # the whole decode step of the scheduler's rows, full and delta

``--steps`` times the engine's decode step instead (random weights of the 7B shape, the scheduler's rows of their
own lengths, every row at ``tokens``, a CUDA graph replayed; medians of ``--reps`` steps): a contiguous cache against
a pool whose pages are shuffled, under ``full`` and ``delta`` (``--budget`` tokens of pages, the Δ-layers of
``benchmarks/decode.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rolecall.cli.command import Parser

PAGE = 16


def paged_copy(k: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [B, Hkv, T, D]`` as a pool ``[B·T/16 + 1, Hkv, 16, D]`` in shuffled page order (page 0 the null page) and
    its ``[B, T/16]`` int32 block table."""
    b, hkv, t, d = k.shape
    w = t // PAGE
    table = (torch.randperm(b * w, generator=gen) + 1).view(b, w).to(torch.int32).to(k.device)
    pool = torch.zeros(b * w + 1, hkv, PAGE, d, dtype=k.dtype, device=k.device)
    pool[table.reshape(-1).long()] = k.view(b, hkv, w, PAGE, d).permute(0, 2, 1, 3, 4).reshape(b * w, hkv, PAGE, d)
    return pool, table


CALLS = 16  # calls captured in one timed graph


def graph_ms(fn: Any, args: Any) -> float:
    """Median milliseconds of one call of ``fn`` inside a CUDA graph of :data:`CALLS` calls, as a decode step runs
    its kernels: no launch or Python overhead charged to a call (the warm-up compiles the kernels beside)."""
    from benchmarks.timing import median_ms
    from rolecall.runtime.kernels import graphed

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), graphed():
        for _ in range(max(args.warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), graphed():
        for _ in range(CALLS):
            fn()
    return median_ms(graph.replay, reps=args.reps) / CALLS


def case_rows(tokens: int, rows: int, args: Any) -> list[dict[str, Any]]:
    from rolecall.runtime.kernels.page_scores import triton as scores
    from rolecall.runtime.kernels.paged_attention import gather_pages
    from rolecall.runtime.kernels.rope_cache import triton as rope
    from rolecall.runtime.kernels.sparse_attention import triton as attention

    hq, hkv, d = args.heads
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(tokens + rows)
    k = torch.randn(rows, hkv, tokens, d, generator=gen).to("cuda", dtype)
    v = torch.randn(rows, hkv, tokens, d, generator=gen).to("cuda", dtype)
    kp, table = paged_copy(k, gen)
    vp = torch.zeros_like(kp)
    vp[table.reshape(-1).long()] = v.view(rows, hkv, -1, PAGE, d).permute(0, 2, 1, 3, 4).reshape(-1, hkv, PAGE, d)
    q = torch.randn(rows, hq, d, generator=gen).to("cuda", dtype)
    span = (torch.zeros(rows, dtype=torch.long, device="cuda"), torch.full((rows,), tokens - 1, device="cuda"))
    n = args.budget // PAGE
    pages = torch.stack([torch.randperm(tokens // PAGE, generator=gen)[:n].sort().values
                         for _ in range(rows * hkv)]).view(rows, hkv, n).to("cuda", torch.int32)
    scale = d ** -0.5
    calls = {
        "dense": lambda paged: attention.sparse_decode_attention(
            q, *(kp, vp) if paged else (k, v), scale=scale, key_span=span, out_dtype=dtype,
            **({"block_table": table} if paged else {})),
        "keep-logits": lambda paged: scores.decode_keeping_logits(
            q, *(kp, vp) if paged else (k, v), scale, key_span=span, out_dtype=dtype,
            **({"block_table": table} if paged else {})),
        "pages": lambda paged: attention.sparse_decode_attention(
            q, *(kp, vp) if paged else (k, v), pages, scale=scale, block_size=PAGE, key_span=span, out_dtype=dtype,
            **({"block_table": table} if paged else {})),
    }
    y = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen).to("cuda", dtype)
    cos, sin = torch.randn(rows, d, generator=gen).to("cuda", dtype), torch.randn(rows, d, generator=gen).to("cuda", dtype)
    slot = torch.randint(0, tokens, (rows,), generator=gen).to("cuda")
    calls["store"] = lambda paged: (rope.rope_and_store(
        y, hq, hkv, cos, sin, *(kp, vp) if paged else (k, v), slot, **({"block_table": table} if paged else {})),)
    out = []
    for mode, call in calls.items():
        if mode == "store":  # both layouts hold the same tokens after the store
            call(True), call(False)
            diff = (gather_pages(kp, table).float() - k.float()).abs().max().item()
        else:
            diff = (call(True)[0].float() - call(False)[0].float()).abs().max().item()
        flat = graph_ms(lambda c=call: c(False), args)
        paged = graph_ms(lambda c=call: c(True), args)
        out.append({"tokens": tokens, "rows": rows, "mode": mode, "contiguous_us": 1e3 * flat, "paged_us": 1e3 * paged,
                    "paged_over_contiguous": paged / flat, "max_abs_diff": diff})
    return out


def step_rows(tokens: int, rows: int, args: Any) -> list[dict[str, Any]]:
    """The decode step of ``rows`` scheduler rows at ``tokens`` tokens each, contiguous and paged, full and delta."""
    from benchmarks.decode import _config, delta_manifest, recent_pages
    from benchmarks.timing import median_ms
    from rolecall.runtime.engine import SHAPES, StaticDecoder, Weights
    from rolecall.runtime.engine.batcher import RowStopper
    from rolecall.runtime.memory import pages
    from rolecall.runtime.policies import get_policy

    shape = SHAPES["7b"]
    weights = Weights.random(shape, "cuda", getattr(torch, args.dtype), positions=tokens + 512)
    out = []
    for name in ("full", "delta"):
        if name == "full":
            policy = get_policy("full")
        else:
            policy = get_policy("delta", budget=args.budget, page_size=PAGE, recent_pages=recent_pages(args.budget))
            policy.bind(delta_manifest(shape), _config(shape))
        times = {}
        for paged in (False, True):
            slots = tokens + 256
            stopper = RowStopper(rows, 1, 0, "cuda")
            stopper.finished.zero_()
            stopper.limits.fill_(1 << 30)
            pool = rows * pages(slots) + 1 if paged else None
            dec = StaticDecoder(weights, policy, rows, slots, min_context=0, stopper=stopper, row_lengths=True,
                                pages=pool)
            dec.cache.fill_random()
            if paged:  # every row's pages, shuffled over the pool
                order = torch.randperm(rows * pages(slots), generator=torch.Generator().manual_seed(rows)) + 1
                dec.cache.table.copy_(order.view(rows, -1).to(torch.int32))
            dec.cache.length.fill_(tokens)
            dec.position = tokens
            dec.capture()
            times[paged] = median_ms(dec.step, reps=args.reps, warmup=args.warmup)
            del dec
            torch.cuda.empty_cache()
        out.append({"tokens": tokens, "rows": rows, "mode": f"step {name}", "contiguous_us": 1e3 * times[False],
                    "paged_us": 1e3 * times[True], "paged_over_contiguous": times[True] / times[False],
                    "max_abs_diff": None})
    return out


def parse_args(argv: list[str] | None = None) -> Any:
    """The flags, checked (a usage error in one line before any work)."""
    p = Parser(prog="paged.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="32768x8,131072x1", help="comma-separated TOKENSxROWS")
    p.add_argument("--heads", default="28,4,128", help="query heads, KV heads, head dim (default: DS-Qwen-7B's)")
    p.add_argument("--budget", type=int, default=1024, help="tokens a KV head reads in the pages mode")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", action="store_true", help="time the engine's decode step on the scheduler's rows")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cases = []
    for part in args.cases.split(","):
        tokens, _, rows = part.strip().partition("x")
        if not (tokens.isdigit() and rows.isdigit() and int(tokens) >= PAGE and int(tokens) % PAGE == 0
                and int(rows) >= 1):
            p.error(f"--cases {part!r}: give TOKENSxROWS, tokens a multiple of {PAGE}, rows ≥ 1 (32768x8)")
        cases.append((int(tokens), int(rows)))
    args.cases = cases
    heads = args.heads.split(",")
    if len(heads) != 3 or not all(h.isdigit() and int(h) > 0 for h in heads) or int(heads[0]) % int(heads[1]):
        p.error(f"--heads {args.heads}: give Hq,Hkv,D, Hq a multiple of Hkv (28,4,128)")
    args.heads = tuple(int(h) for h in heads)
    if not PAGE <= args.budget <= min(t for t, _ in cases) or args.budget % PAGE:
        p.error(f"--budget {args.budget}: a multiple of {PAGE} within the shortest case")
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be ≥ 1 and --warmup ≥ 0")
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.timing import gpu_slug

    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("paged.py: error: this benchmark needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; heads {args.heads} {args.dtype}; median of {args.reps} calls")
    print(f"{'case':>12} {'mode':>12} {'contig µs':>10} {'paged µs':>10} {'paged/contig':>13} {'max diff':>9}")
    rows = []
    for tokens, n in args.cases:
        for r in (step_rows if args.steps else case_rows)(tokens, n, args):
            rows.append(r)
            diff = "" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:>9.2e}"
            print(f"{f'{tokens}x{n}':>12} {r['mode']:>12} {r['contiguous_us']:>10.1f} {r['paged_us']:>10.1f} "
                  f"{r['paged_over_contiguous']:>13.3f} {diff}")
    suffix = "_steps" if args.steps else ""
    out = Path(args.out or f"benchmarks/results/paged{suffix}_{gpu_slug(gpu)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "settings": settings, "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
