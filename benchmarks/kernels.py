"""Decode-attention kernels on a GPU: rolecall's Triton kernels against the best dense decode in the same process.

    python -m benchmarks.kernels --out kernels.json

For each context T and batch B (Hq 32 / Hkv 8 / D 128, bf16, 64-token blocks) it times, as medians of CUDA-event
timings after warm-up, on K/V buffers rotated so the 50 MB L2 cache cannot serve repeats:

Every call is captured in a CUDA graph of ``--calls-per-graph`` calls (16), as a decode step runs, so neither
launch overhead nor the graph's own launch counts. rolecall's calls are launched as the engine launches them
(``choose_launch``: programs a row, tile and stages from the rows, the GPU's SMs and its shared memory; each row
of the JSON names the launch). ``--sweep`` also times the split launch at other warps, stages, tiles and chunks.
A call of fewer programs than SMs (one program a row below the SMs' count) lets the next call of the graph start
on the idle SMs, which a decode step's next kernel, reading its output, does not: such calls look faster here than
in a step (``benchmarks/decode.py`` times the step, with ``--policies full,full-flashinfer`` against FlashInfer).
``--rounds N`` times every shape N times over, one shape after another, and reports each call's median of the rounds
(their values under ``rounds_ms``): a dense call at the memory's limit moves by about 1 % from run to run, as much
as rolecall's and FlashInfer's dense calls differ there.

* ``sdpa``: torch SDPA (flash backend where it takes GQA decode) on the whole cache: the dense baseline;
* ``ours_dense``: the Triton kernel reading every token;
* ``sparse_r``: the Triton kernel where r of the 8 KV heads read 10 % of the blocks and the others read
  everything, in one launch (LycheeDecode's mixed retrieval/sparse layer; r = 8 is a fully sparse layer);
* ``gather_sdpa``: the naive route, gathering 10 % of the blocks of every head and running SDPA on them;
* ``page_scores``: a second pass over K that scores pages from the attention pass's log-sum-exp;
* ``flashinfer_dense`` / ``flashinfer_sparse`` (when ``flashinfer`` imports): the peer, FlashInfer's paged
  decode over the same cache, dense and through a page table listing only the chosen pages per KV head;
* ``decode_and_score``: the fused Δ-layer path (attention that keeps its logits, then a pass over the logits):
  its time over ``ours_dense`` is the selection overhead DELTA reports (154 % at 1K, 25 % at 32K).

``--linear`` adds the decode step's projections (DS-Qwen-7B and 1.5B shapes, 1 / 8 / 16 rows, or ``--rows``): the
linear layer the engine runs (``rolecall.runtime.kernels.skinny_linear.linear``) against ``F.linear`` (cuBLAS), weights rotated
past L2, and for gate/up the engine's gated MLP (``gated_linear``) against cuBLAS then a compiled activation.
``--linear-tiles`` sweeps the Triton kernel's ``tl.dot`` tiles (features × columns × warps × stages, 128 of them) on
each projection (and Llama-3-8B's gate/up) at 2 / 8 / 16 rows (or ``--rows``) against cuBLAS, and times the gated
gate/up kernel (``act(gate) · up`` written by the projection) against the projection followed by the activation
in eager kernels.
``--topk`` adds the engine's top-k selection (rows of 2,048 and 8,192 block scores, 8 to 256 rows, k = 128 and
512): the Triton kernel as the engine runs it (``split``), and in one program per row by radix counting (2 bits a
round) and by histogram (8 bits a round) at 4 / 8 / 16 warps, against ``torch.topk``.
``--refine`` adds DELTA's two-stage second stage (``rolecall.runtime.kernels.page_bounds.refine_candidates``: the Quest
bounds of 512 candidate pages of 8,192 per KV head, DS-Qwen-7B heads, then the choice of 128), scored by 1, 2, 4
or 8 programs per head; the page-metadata update (``update_page``) alone; and both in one launch (``new_page=``),
as the engine's step runs them.

``--many-rows`` adds attention calls over 32 to 256 rows of (sequence, KV head) (DS-Qwen-1.5B, 7B and Llama-3-8B
heads): 1K and 2K tokens of 16-token pages or single tokens of an 18K cache, 10 % of the 64-token blocks of 128K,
and dense rows of 512 to 128K tokens, with and without kept logits. Each is timed as one program a row in
128-token tiles and as the split launch with its merge (``choose_chunk``, 64-token tiles), with the launch the
engine takes (``choose_launch``).

It prints a table and writes JSON with the GPU's name, a measured device-to-device copy bandwidth, the bytes
each kernel must read, the achieved bandwidth, and the byte-bound speedup limit of each sparse setting.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from benchmarks import peers
from benchmarks.report import at_least
from benchmarks.timing import copy_bandwidth, median_ms
from rolecall.cli import Parser
from rolecall.core.atomic import write_text
from rolecall.runtime.kernels import graphed, max_shared, pdl, peak_bandwidth, sm_count
from rolecall.runtime.kernels.page_scores import triton as page_tri
from rolecall.runtime.kernels.sparse_attention import triton as tri

HQ, HKV, D, BLOCK, KEEP = 32, 8, 128, 64, 0.10
SPARSE_HEADS = (0, 4, 8)  # KV heads of 8 that read 10 % of the blocks in the mixed calls (sparse_r)
L2_BYTES = 256 * 2**20  # rotate buffers until this much: well above any Hopper L2


class Rotating:
    """Several copies of a batch of K/V caches, cycled through so repeats miss the L2 cache."""

    def __init__(self, b: int, t: int, copies: int | None = None):
        size = 2 * b * HKV * t * D * 2
        n = copies or max(1, math.ceil(L2_BYTES / size))
        self.sets = [(torch.randn(b, HKV, t, D, device="cuda", dtype=torch.bfloat16),
                      torch.randn(b, HKV, t, D, device="cuda", dtype=torch.bfloat16)) for _ in range(n)]
        self.i = 0

    @classmethod
    def of(cls, sets: list) -> Rotating:
        """Cycle through given pairs of tensors (a weight and its bias, say)."""
        rotating = cls.__new__(cls)
        rotating.sets, rotating.i = sets, 0
        return rotating

    def next(self):
        self.i = (self.i + 1) % len(self.sets)
        return self.sets[self.i]


def sparse_indices(b: int, t: int, g: torch.Generator) -> torch.Tensor:
    """10 % of the blocks of every row, always including the last (recent) block: ``[B, Hkv, N]`` int32."""
    blocks = math.ceil(t / BLOCK)
    n = max(1, round(KEEP * blocks))
    rows = torch.rand(b * HKV, blocks, generator=g, device="cuda").argsort(dim=1)[:, : n - 1]
    last = torch.full((b * HKV, 1), blocks - 1, device="cuda")
    rows = torch.where(rows == blocks - 1, rows.new_tensor(0), rows)
    return torch.cat([rows, last], dim=1).sort(dim=1).values.view(b, HKV, n).to(torch.int32)


def sdpa_dense(q4, k, v):
    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)


def pick_sdpa_backend(q4, k, v) -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                sdpa_dense(q4, k, v)
            return name
        except RuntimeError:
            continue
    return "default"


CALLS_PER_GRAPH = 16  # calls captured in one timed graph (--calls-per-graph)


def graph_ms(fn, kv: Rotating, reps: int = 20) -> float:
    """Median milliseconds of one call of ``fn(k, v)`` inside a CUDA graph of at least ``CALLS_PER_GRAPH`` calls,
    cycling through the rotating cache copies.

    A decode step runs as one graph of hundreds of kernels (no launch or Python overhead, and no graph launch
    per kernel), so kernels are timed the same way: the graph's own launch is shared by its calls, not charged
    to one. With a single call a graph (the old way for caches too large to rotate), the replay's few µs went to
    the kernel, which weighs on a 0.1 ms sparse call and not on a 1 ms dense one."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), graphed():  # warm-up: compiles the kernels a decode step's capture launches
        for k, v in kv.sets:
            fn(k, v)
    torch.cuda.current_stream().wait_stream(side)
    rounds = max(1, math.ceil(CALLS_PER_GRAPH / len(kv.sets)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), graphed():
        for _ in range(rounds):
            for k, v in kv.sets:
                fn(k, v)
    return median_ms(graph.replay, reps=reps) / (rounds * len(kv.sets))


def engine_launch(b: int, tokens: int, dense: bool) -> dict:
    """The launch the engine takes for a call of ``b`` sequences × :data:`HKV` KV heads, each row reading
    ``tokens`` (``dense``: the whole cache, else a gathered set): ``choose_launch`` on this GPU's SMs and shared
    memory, as programs a row, tile and stages."""
    probe = torch.empty(1, device="cuda", dtype=torch.bfloat16)
    chunk, tile, stages = tri.choose_launch(tokens, b * HKV, sm_count(probe), dense=dense, head_dim=D, itemsize=2,
                                            shared=max_shared(probe), bandwidth=peak_bandwidth(probe))
    return {"programs_a_row": math.ceil(tokens / chunk), "tile": tile, "stages": stages}


def bench_config(b: int, t: int, g: torch.Generator) -> dict:
    """One round of timings at ``b`` sequences × ``t`` tokens: each call's median milliseconds (keys ending in
    ``_ms``) beside the shape and the launches (:func:`derive` adds the ratios)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv = Rotating(b, t)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    q4 = q[:, :, None, :]
    scale = D**-0.5
    idx = sparse_indices(b, t, g)
    row = {"batch": b, "context": t, "blocks_read_per_sparse_head": int(idx.shape[-1]),
           "dense_launch": engine_launch(b, t, dense=True),
           "sparse_launch": engine_launch(b, idx.shape[-1] * BLOCK, dense=False)}

    backend = pick_sdpa_backend(q4, *kv.sets[0])
    row["sdpa_backend"] = backend
    backends = {"flash": [SDPBackend.FLASH_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
                "cudnn": [SDPBackend.CUDNN_ATTENTION]}.get(backend)

    def run_sdpa(k, v):
        if backends:
            with sdpa_kernel(backends):
                return sdpa_dense(q4, k, v)
        return sdpa_dense(q4, k, v)

    row["sdpa_ms"] = graph_ms(run_sdpa, kv)
    # every rolecall call below is the engine's: the launch choose_launch picks (no tile, warps or stages given)
    row["ours_dense_ms"] = graph_ms(lambda k, v: tri.sparse_decode_attention(q, k, v, scale=scale), kv)
    for r in SPARSE_HEADS:
        # r = 8 is a fully sparse layer, called as the engine calls it (no full_rows)
        full = (torch.arange(HKV, device="cuda") >= r).expand(b, HKV).contiguous() if r < HKV else None
        row[f"sparse_{r}_ms"] = graph_ms(lambda k, v, full=full: tri.sparse_decode_attention(
            q, k, v, idx, scale=scale, block_size=BLOCK, full_rows=full), kv)

    bi = torch.arange(b, device="cuda")[:, None, None]
    hi = torch.arange(HKV, device="cuda")[None, :, None]
    blk = idx.long()
    blocks = t // BLOCK

    def gather_then_sdpa(k, v):
        kb = k[:, :, : blocks * BLOCK].view(b, HKV, blocks, BLOCK, D)[bi, hi, blk].flatten(2, 3)  # [B, Hkv, M, D]
        vb = v[:, :, : blocks * BLOCK].view(b, HKV, blocks, BLOCK, D)[bi, hi, blk].flatten(2, 3)
        return sdpa_dense(q4, kb, vb)

    row["gather_sdpa_ms"] = graph_ms(gather_then_sdpa, kv)
    _, lse = tri.sparse_decode_attention(q, *kv.sets[0], scale=scale)
    row["page_scores_ms"] = graph_ms(lambda k, v: page_tri.page_scores(q, k, lse, scale, 16), kv)
    row["decode_and_score_ms"] = graph_ms(lambda k, v: page_tri.decode_and_score(q, k, v, scale, 16), kv)
    if peers.flashinfer_available():
        row.update(flashinfer_peer(b, t, q, kv, idx))
    kv.sets.clear()
    torch.cuda.empty_cache()
    return row


def merge_rounds(rounds: list[dict]) -> dict:
    """One row from several rounds at one shape: each ``_ms`` key's median over the rounds (their values kept under
    ``rounds_ms`` where there are several), the rest from the first round."""
    row = dict(rounds[0])
    if len(rounds) > 1:
        row["rounds_ms"] = {k: [r[k] for r in rounds] for k in row if k.endswith("_ms")}
        row.update({k: statistics.median(v) for k, v in row["rounds_ms"].items()})
    return row


def derive(row: dict, copy_bw: float) -> dict:
    """``row`` with the ratios of its timings: bytes read, speed-ups, byte limits, shares of the copy bandwidth,
    the selection's overhead and FlashInfer's sparse time over rolecall's."""
    b, t = row["batch"], row["context"]
    kv_bytes_row = t * D * 2 * 2  # K and V of one (sequence, KV head), bf16
    dense_bytes = b * HKV * kv_bytes_row
    sparse_bytes_row = row["blocks_read_per_sparse_head"] * BLOCK * D * 2 * 2
    for r in SPARSE_HEADS:
        read = b * ((HKV - r) * kv_bytes_row + r * sparse_bytes_row)
        row[f"sparse_{r}_bytes"] = read
        row[f"sparse_{r}_speedup_vs_sdpa"] = row["sdpa_ms"] / row[f"sparse_{r}_ms"]
        row[f"sparse_{r}_byte_limit"] = dense_bytes / read
        row[f"sparse_{r}_bandwidth_fraction"] = read / (row[f"sparse_{r}_ms"] / 1e3) / copy_bw
    row["selection_overhead"] = row["page_scores_ms"] / row["ours_dense_ms"]
    row["selection_overhead_fused"] = row["decode_and_score_ms"] / row["ours_dense_ms"] - 1.0
    row["sdpa_bandwidth_fraction"] = dense_bytes / (row["sdpa_ms"] / 1e3) / copy_bw
    row["ours_dense_bandwidth_fraction"] = dense_bytes / (row["ours_dense_ms"] / 1e3) / copy_bw
    if "flashinfer_sparse_ms" in row:
        row["flashinfer_sparse_vs_ours"] = row["flashinfer_sparse_ms"] / row["sparse_8_ms"]
    return row


def flashinfer_peer(b: int, t: int, q: torch.Tensor, kv: Rotating, idx: torch.Tensor) -> dict:
    """FlashInfer's paged decode on the same cache (:func:`benchmarks.peers.flashinfer_decode`): each (sequence,
    KV head) is one request whose pages are 64-token slices of ``[B, Hkv, T, D]``, so dense reads every page and
    sparse lists only the chosen pages per KV head in its page table, as DELTA's and Quest's engines do."""
    rows = b * HKV
    workspace = torch.empty(peers.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    tables = {"dense": (torch.arange(t // BLOCK, device="cuda").expand(rows, -1), t),
              "sparse": (idx.view(rows, -1), idx.shape[-1] * BLOCK)}
    out = {"flashinfer_version": peers.flashinfer_version()}
    for name, (table, tokens) in tables.items():
        run = peers.flashinfer_decode(table, tokens, HQ // HKV, D, BLOCK, torch.bfloat16, workspace=workspace)
        out[f"flashinfer_{name}_ms"] = graph_ms(lambda k, v, run=run: run(q, k, v), kv)
    return out


def tune(g: torch.Generator) -> dict:
    """``--sweep``: the headline case (128K, batch 8, all heads sparse) at each num_warps / num_stages of the split
    launch (reported beside the engine's launch, not used by it)."""
    b, t = 8, 131072
    kv = Rotating(b, t, copies=1)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    idx = sparse_indices(b, t, g)
    results = {}
    for warps in (4, 8):
        for stages in (1, 2, 3, 4):
            results[f"{warps}w{stages}s"] = graph_ms(lambda k, v, w=warps, s=stages: tri.sparse_decode_attention(
                q, k, v, idx, scale=D**-0.5, block_size=BLOCK, num_warps=w, num_stages=s), kv)
    results["engine"] = graph_ms(lambda k, v: tri.sparse_decode_attention(
        q, k, v, idx, scale=D**-0.5, block_size=BLOCK), kv)
    return results


def sweep(b: int, t: int, g: torch.Generator) -> dict:
    """Sparse (all heads, 10 %) time per tile / chunk / warps / stages at one shape."""
    kv = Rotating(b, t)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    idx = sparse_indices(b, t, g)
    out = {}
    for tile in (32, 64, 128):
        for chunk in (None, 512, 1024, 2048):
            for warps, stages in ((4, 2), (4, 3), (8, 2), (8, 3)):
                if chunk is not None and chunk < tile:
                    continue
                out[f"t{tile}c{chunk}w{warps}s{stages}"] = graph_ms(
                    lambda k, v, a=(tile, chunk, warps, stages): tri.sparse_decode_attention(
                        q, k, v, idx, scale=D**-0.5, block_size=BLOCK, tile=a[0], chunk=a[1], num_warps=a[2],
                        num_stages=a[3]), kv)
    kv.sets.clear()
    return out


MANY_ROWS = [  # (heads, Hq, Hkv, batch, tokens a row, kind): 32 to 256 rows of (sequence, KV head)
    *((name, hq, hkv, b, tokens, "pages")
      for name, hq, hkv, batches in (("1.5b", 12, 2, (16, 32, 48, 64)), ("7b", 28, 4, (8, 16, 24, 32, 64)))
      for b in batches for tokens in (1024, 2048)),
    *((name, hq, hkv, b, tokens, kind) for name, hq, hkv in (("1.5b", 12, 2), ("7b", 28, 4)) for b in (32, 64)
      for tokens in (512, 1024, 2048, 4096, 8192, 18432) for kind in ("dense", "logits")),
    # long rows at 64 rows: Llama-3-8B heads at batch 8 (the kernel rows' shape), 7B heads at batch 16
    *((name, hq, hkv, b, tokens, kind) for name, hq, hkv, b in (("llama8b", 32, 8, 8), ("7b", 28, 4, 16))
      for tokens, kind in ((32768, "dense"), (131072, "dense"), (13120, "blocks"), (2048, "pages"))),
    # sets of single tokens (Lethe's and vAttention's) from 64 to 256 rows
    *((name, hq, hkv, b, tokens, "tokens") for name, hq, hkv, batches in (("1.5b", 12, 2, (32, 48, 64)),
                                                                          ("7b", 28, 4, (32, 64)))
      for b in batches for tokens in (1024, 2048)),
]


def _many_rows_call(kind: str, q: torch.Tensor, idx: torch.Tensor | None, size: int, launch: dict):
    """One call of :func:`many_rows` on ``(k, v)``: attention that keeps its logits, or plain attention."""
    if kind == "logits":
        return lambda k, v: page_tri.decode_keeping_logits(q, k, v, D**-0.5, out_dtype=torch.bfloat16, **launch)
    return lambda k, v: tri.sparse_decode_attention(q, k, v, idx, scale=D**-0.5, block_size=size,
                                                    out_dtype=torch.bfloat16, **launch)


def many_rows(copy_bw: float, g: torch.Generator, t: int = 18432, page: int = 16) -> list[dict]:
    """Calls over many rows (:data:`MANY_ROWS`; ``pages``: 16-token pages of a ``t``-token cache; ``tokens``: single
    tokens of it; ``blocks``: 64-token blocks of a 128K cache; ``dense``: a cache of the row's length; ``logits``:
    the same, keeping its logits as a Δ-layer does): one program a row in 128-token tiles three stages deep against
    the split launch and its merge (:func:`choose_chunk`, 64-token tiles, two stages), and which of the two the
    engine takes (:func:`choose_launch`)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for name, hq, hkv, b, tokens, kind in MANY_ROWS:
        dense = kind in ("dense", "logits")
        length = tokens if dense else (131072 if kind == "blocks" else t)
        copies = max(2, math.ceil(L2_BYTES / (2 * b * hkv * length * D * 2)))
        kv = Rotating.of([(torch.randn(b, hkv, length, D, device="cuda", dtype=torch.bfloat16),
                           torch.randn(b, hkv, length, D, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)])
        q = torch.randn(b, hq, D, device="cuda", dtype=torch.bfloat16)
        idx = None
        size = {"blocks": 64, "tokens": 1}.get(kind, page)  # blocks: 10 % of the 64-token blocks of a 128K cache
        if not dense:
            n = tokens // size
            pages = torch.rand(b * hkv, length // size, generator=g, device="cuda").argsort(dim=1)[:, :n]
            idx = pages.sort(dim=1).values.view(b, hkv, n).to(torch.int32)
        launches = {"one_ms": {"chunk": 128 * math.ceil(tokens / 128), "tile": 128, "num_stages": 3},
                    "split_ms": {"chunk": tri.choose_chunk(tokens, b * hkv, sms, dense=dense), "tile": 64,
                                 "num_stages": 2}}
        one = tri.choose_launch(tokens, b * hkv, sms, dense=dense, head_dim=D, shared=max_shared(q),
                                bandwidth=peak_bandwidth(q))[1] == 128
        row = {"heads": name, "batch": b, "rows": b * hkv, "tokens": tokens, "kind": kind,
               "engine": "one program a row" if one else "split"}
        for key, launch in launches.items():
            row[key] = graph_ms(_many_rows_call(kind, q, idx, size, launch), kv)
        row["engine_bandwidth_fraction"] = (b * hkv * tokens * D * 4 / (row["one_ms" if one else "split_ms"] / 1e3)
                                            / copy_bw)
        print(f"many rows: {name} heads, {b:3d} × {hkv} rows, {tokens:5d} tokens, {kind:6s}: one program a row "
              f"{row['one_ms'] * 1e3:6.1f} µs, split {row['split_ms'] * 1e3:6.1f} µs; the engine: {row['engine']}",
              flush=True)
        out.append(row)
        kv.sets.clear()
    return out


PROJECTIONS = {  # name: (N, K, bias) of y = x W^T (+ b)
    "7b qkv": (4608, 3584, True), "7b o": (3584, 3584, False), "7b gate_up": (37888, 3584, False),
    "7b down": (3584, 18944, False), "1.5b qkv": (2048, 1536, True), "1.5b o": (1536, 1536, False),
    "1.5b gate_up": (17920, 1536, False), "1.5b down": (1536, 8960, False),
    "llama8b gate_up": (28672, 4096, False),  # N = 7 K: where the wide tiles' rule (N >= 8 K) stops
    "gemma4b qkv": (4096, 2560, False), "gemma4b o": (2560, 2048, False), "gemma4b gate_up": (20480, 2560, False),
    "gemma4b down": (2560, 10240, False), "gemma4b head": (262208, 2560, False),  # Gemma 3 4B: heads of 256, tied
}


def projection_copies(n: int, k: int, bias: bool) -> list[tuple]:
    """Enough random ``(weight [N, K], bias)`` copies of a projection that cycling through them misses L2."""
    copies = max(2, math.ceil(L2_BYTES / (n * k * 2)))
    return [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,
             torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None) for _ in range(copies)]


def projection_cases(rows_list, projections=()):
    """``(name, n, k, rows, x, copies)`` for each projection (or those named) at each row count: bf16 activations
    and :func:`projection_copies` of its weight, made once per projection."""
    for name, (n, k, bias) in PROJECTIONS.items():
        if projections and name not in projections:
            continue
        ws = projection_copies(n, k, bias)
        for rows in rows_list:
            yield name, n, k, rows, torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), ws
        del ws


def tile_label(config) -> str:
    """A ``tl.dot`` tile's name in the sweep's tables: features × columns, warps, stages (and split)."""
    return (f"{config.block_n}x{config.block_k} w{config.warps} s{config.stages}"
            + (f" split{config.split}" if config.split > 1 else ""))


def linear_rows(copy_bw: float, rows_list=(1, 8, 16), projections=()) -> list[dict]:
    """The engine's linear layer against cuBLAS on each projection, as a decode step runs it (graph-captured,
    each call a different copy of the weight so that none is served from L2)."""
    from rolecall.runtime.kernels.skinny_linear import gated_linear, kernel_config, linear

    projection_then_silu = torch.compile(lambda x, w: (lambda g, u: F.silu(g) * u)(*F.linear(x, w).chunk(2, -1)))
    out = []
    for name, n, k, rows, x, ws in projection_cases(rows_list, projections):
        times = {}
        for label, fn in (("cublas", F.linear), ("rolecall", linear)):
            times[label] = graph_ms(lambda w, b, fn=fn, x=x: fn(x, w, b), Rotating.of(ws))
        out.append({"projection": name, "rows": rows, "n": n, "k": k,
                    "kernel": kernel_config(rows, n, k, shared=max_shared(x)) is not None,
                    "cublas_ms": times["cublas"], "rolecall_ms": times["rolecall"],
                    "cublas_bw_fraction": n * k * 2 / (times["cublas"] * 1e-3) / copy_bw,
                    "rolecall_bw_fraction": n * k * 2 / (times["rolecall"] * 1e-3) / copy_bw})
        r = out[-1]
        gated = ""
        if name.endswith("gate_up"):  # the MLP as the engine runs it, against cuBLAS and a fused activation
            r["gated_ms"] = graph_ms(lambda w, b, x=x: gated_linear(x, w, "silu"), Rotating.of(ws))
            r["cublas_then_activation_ms"] = graph_ms(lambda w, b, x=x: projection_then_silu(x, w), Rotating.of(ws))
            gated = (f"; gated {1e3 * r['gated_ms']:.1f} µs against cuBLAS then the activation "
                     f"{1e3 * r['cublas_then_activation_ms']:.1f}")
        print(f"linear {name:>13} rows {rows:>2}: cuBLAS {1e3 * r['cublas_ms']:6.1f} µs "
              f"({r['cublas_bw_fraction']:.0%}), rolecall {1e3 * r['rolecall_ms']:6.1f} µs "
              f"({r['rolecall_bw_fraction']:.0%}){'' if r['kernel'] else ' (cuBLAS)'}{gated}", flush=True)
    return out


TILES = [(bn, bk, warps, stages) for bn in (16, 32, 64, 128) for bk in (64, 128, 256, 512) for warps in (4, 8)
         for stages in (2, 3, 4, 5)]
SPLIT_TILES = [(bn, bk, warps, stages, split) for bn in (16, 32, 64, 128) for bk in (64, 128, 256) for warps in (4, 8)
               for stages in (3, 4) for split in (2, 4, 8, 16)]  # the split kernel's, on long narrow projections (K >= 4 N)
GATED_TILES = [(bn, bk, warps, stages) for bn in (32, 64, 128, 256) for bk in (32, 64, 128, 256) for warps in (4, 8)
               for stages in (2, 3, 4, 5)]  # the gated kernel's (features of both halves), on gate/up projections


def linear_tile_rows(rows_list=(2, 8, 16), projections=()) -> list[dict]:
    """Every ``tl.dot`` tile of the skinny kernel on each projection (or those named) against cuBLAS (tiles that
    do not fit shared memory are skipped), the split kernel's tiles on the long narrow ones, and the gated
    gate/up kernel against the projection then the activation."""
    from triton.runtime.errors import OutOfResources

    from rolecall.runtime.kernels.skinny_linear import activation, gated_linear, kernel_config
    from rolecall.runtime.kernels.skinny_linear.naive import Config
    from rolecall.runtime.kernels.skinny_linear.triton import launch

    def tile_times(x, ws, tiles, gated=None) -> dict[str, float]:
        """Milliseconds of each ``tl.dot`` tile that fits (``gated``: the gated kernel, no bias)."""
        times = {}
        for config in (Config(True, *tile) for tile in tiles):
            call = lambda w, b, c=config: launch(x, w, None if gated else b, c, gated=gated)  # noqa: E731
            try:  # compiled outside the graph: a tile that does not fit fails here
                call(*ws[0])
            except OutOfResources:
                continue
            times[tile_label(config)] = graph_ms(call, Rotating.of(ws))
        return times

    out = []
    for name, n, k, rows, x, ws in projection_cases(rows_list, projections):
        times = {"cublas": graph_ms(lambda w, b, x=x: F.linear(x, w, b), Rotating.of(ws))}
        times.update(tile_times(x, ws, TILES + (SPLIT_TILES if k >= 4 * n else [])))
        chosen = kernel_config(rows, n, k, shared=max_shared(x))
        row = {"projection": name, "rows": rows, "n": n, "k": k, "times_ms": times,
               "engine_tile": None if chosen is None else tile_label(chosen)}
        if name.endswith("gate_up"):
            row["gated_ms"] = graph_ms(lambda w, b, x=x: gated_linear(x, w, "silu"), Rotating.of(ws))
            row["gated_tiles_ms"] = tile_times(x, ws, GATED_TILES, gated="silu")
            chosen = kernel_config(rows, n, k, gated=True, shared=max_shared(x))
            row["engine_gated_tile"] = None if chosen is None else tile_label(chosen)
            row["projection_then_activation_ms"] = graph_ms(
                lambda w, b, x=x: (lambda g, u: activation(g, "silu") * u)(*F.linear(x, w).chunk(2, -1)),
                Rotating.of(ws))
        out.append(row)
        best = sorted(times, key=times.get)[:3]
        print(f"tiles {name:>13} rows {rows:>2}: " + ", ".join(f"{t} {1e3 * times[t]:.1f}" for t in best)
              + f" µs (engine: {row['engine_tile'] or 'cublas'})"
              + (f"; gated {1e3 * row['gated_ms']:.1f} µs against {1e3 * row['projection_then_activation_ms']:.1f}"
                 + " (best gated tiles: " + ", ".join(f"{t} {1e3 * row['gated_tiles_ms'][t]:.1f}" for t in
                                                   sorted(row["gated_tiles_ms"], key=row["gated_tiles_ms"].get)[:3])
                 + ")" if "gated_ms" in row else ""), flush=True)
    return out


TOPK_SHAPES = ((8, 8192, 128), (8, 8192, 512), (9, 8192, 128), (256, 8192, 128), (8, 2048, 128),
               (64, 2048, 128))  # (rows, scores per row, k): a Δ-layer's choice at 128K x 8 (512: refine=4), ...


def topk_rows(recent: int = 4) -> list[dict]:
    """The top-k of each row with its recent blocks, graph-captured: the engine's kernel as it runs (``split``:
    rows split over programs where few rows leave the GPU idle), one program per row by radix method and warp
    count, and ``torch.topk`` (unordered) as the baseline."""
    from rolecall.runtime.kernels.topk_select import triton as topk_tri

    out = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows, n, k in TOPK_SHAPES:
        sets = [(torch.randn(rows, n, device="cuda"), None) for _ in range(4)]
        last = torch.full((rows,), n - 1, device="cuda")
        times = {"torch": graph_ms(lambda s, _, w=k: s.topk(w, dim=-1, sorted=False), Rotating.of(sets))}
        times["split"] = graph_ms(lambda s, _, e=last, w=k: topk_tri.topk_with_recent(s, w, recent, e),
                                  Rotating.of(sets))
        for bits in (2, 8):
            for warps in (4, 8, 16):
                times[f"b{bits}w{warps}"] = graph_ms(
                    lambda s, _, b=bits, w=warps, e=last, top=k: topk_tri.topk_with_recent(
                        s, top, recent, e, num_warps=w, bits=b, parts=1),
                    Rotating.of(sets))
        out.append({"rows": rows, "n": n, "k": k, "parts": topk_tri.split_parts(rows, n, k, sms)[0],
                    "us": {key: 1e3 * v for key, v in times.items()}})
        print(f"topk {rows:>3} x {n:>5}, k {k}: " + ", ".join(f"{key} {1e3 * v:.1f}" for key, v in times.items())
              + " µs", flush=True)
    return out


REFINE_SHAPES = ((8, 4, 7), (1, 4, 7))  # (batch, KV heads, query heads per KV head): DS-Qwen-7B at 8 and 1 rows


def refine_rows(pages: int = 8192, candidates: int = 512, k: int = 128, recent: int = 8) -> list[dict]:
    """The refining step of one sparse layer, graph-captured, metadata rotated past L2: ``refine_candidates``
    by how many programs score each head's candidates, and the new token's page update beside it."""
    from rolecall.runtime.kernels.page_bounds import triton as pb_tri
    from rolecall.runtime.kernels.topk_select import triton as topk_tri

    out = []
    for b, hkv, groups in REFINE_SHAPES:
        copies = max(2, math.ceil(L2_BYTES / (2 * b * hkv * pages * D * 2)))
        sets = []
        for _ in range(copies):
            kmin = torch.randn(b, hkv, pages, D, device="cuda", dtype=torch.bfloat16)
            sets.append((kmin, kmin + torch.rand_like(kmin)))
        query = torch.randn(b, hkv * groups, D, device="cuda", dtype=torch.bfloat16)
        cand = topk_tri.topk_with_recent(torch.rand(b, 1, pages, device="cuda"), candidates, recent)
        cand = cand.expand(b, hkv, candidates)  # a Δ-layer's choice, shared by the heads
        times = {}
        for parts in (1, 2, 4, 8):
            times[f"parts{parts}"] = graph_ms(lambda lo, hi, n=parts, q=query, c=cand: pb_tri.refine_candidates(
                q, lo, hi, c, 0.088, k, recent, parts=n), Rotating.of(sets))
        key = torch.randn(b, hkv, pages * 16, D, device="cuda", dtype=torch.bfloat16)
        first = torch.zeros(b, device="cuda", dtype=torch.long)
        last = torch.tensor(pages * 16 - 5, device="cuda")
        times["update_page"] = graph_ms(lambda lo, hi, kc=key, f=first, e=last: pb_tri.update_page(kc, lo, hi, f, e, 16),
                                        Rotating.of(sets))
        times["fused_update"] = graph_ms(lambda lo, hi, q=query, c=cand, kc=key, f=first, e=last: pb_tri.refine_candidates(
            q, lo, hi, c, 0.088, k, recent, new_page=(kc, f, e, 16)), Rotating.of(sets))
        out.append({"batch": b, "kv_heads": hkv, "groups": groups, "pages": pages, "candidates": candidates,
                    "k": k, "us": {name: 1e3 * v for name, v in times.items()}})
        print(f"refine {b} x {hkv} heads, {candidates} of {pages} pages: "
              + ", ".join(f"{name} {1e3 * v:.1f}" for name, v in times.items()) + " µs", flush=True)
        del sets, key
    return out


def tables(args, copy_bw: float, g) -> dict:
    """The extra tables that the flags ask for, beside the attention rows or alone."""
    out = {}
    if args.linear:
        out["linear"] = linear_rows(copy_bw, **args.linear_kw)
    if args.linear_tiles:
        out["linear_tiles"] = linear_tile_rows(**args.linear_kw)
    if args.topk:
        out["topk"] = topk_rows()
    if args.refine:
        out["refine"] = refine_rows()
    if args.many_rows:
        out["many_rows"] = many_rows(copy_bw, g)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked; ``contexts``, ``batches``, ``projections`` as tuples, ``linear_kw`` for the linear
    tables."""
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="kernels.json")
    parser.add_argument("--contexts", default="16384,32768,65536,131072")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--sweep", action="store_true", help="also time tile / chunk / warps / stages per shape")
    parser.add_argument("--linear", action="store_true", help="also time the decode step's linear layers")
    parser.add_argument("--linear-tiles", action="store_true",
                        help="also sweep the linear kernel's tiles and time the gated gate/up kernel")
    parser.add_argument("--rows", default=None,
                        help="rows of the linear layers (default: 1,8,16 for --linear, 2,8,16 for --linear-tiles)")
    parser.add_argument("--projections", default="",
                        help=f"only these projections for --linear / --linear-tiles, comma-separated: "
                             f"{', '.join(PROJECTIONS)}")
    parser.add_argument("--topk", action="store_true", help="also time the top-k selection kernel")
    parser.add_argument("--refine", action="store_true", help="also time DELTA's refining step (second stage)")
    parser.add_argument("--many-rows", action="store_true",
                        help="also time attention calls over 32 to 256 rows: one program a row against the split "
                             "launch")
    parser.add_argument("--no-attention", dest="attention", action="store_false", help="skip the attention rows")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every shape this many times over, shape after shape, and report each call's "
                             "median of the rounds (calls at the memory's limit differ by about 1 %% run to run)")
    parser.add_argument("--calls-per-graph", type=int, default=CALLS_PER_GRAPH,
                        help="calls captured in each timed CUDA graph (at least one per rotating copy; 1: one a copy)")
    args = parser.parse_args(argv)
    at_least(parser, args, calls_per_graph=1, rounds=1)
    parser.check_writable(args.out, "--out")  # written after the timing: refused now if it cannot be
    rows = tuple(parser.counts(args.rows, "--rows", "row counts")) if args.rows else None
    contexts = tuple(parser.counts(args.contexts, "--contexts", "context lengths", low=BLOCK))
    if any(t % BLOCK for t in contexts):
        parser.error(f"--contexts takes multiples of the {BLOCK}-token blocks the sparse calls read, got {args.contexts!r}")
    args.contexts = contexts
    args.batches = tuple(parser.counts(args.batches, "--batches", "batch sizes"))
    args.projections = tuple(parser.names(args.projections, "--projections", PROJECTIONS, none_ok="left out: all"))
    args.linear_kw = {"projections": args.projections, **({"rows_list": rows} if rows else {})}
    return args


def main(argv: list[str] | None = None) -> int:
    global CALLS_PER_GRAPH  # graph_ms reads it: set once from --calls-per-graph
    args = parse_args(argv)
    CALLS_PER_GRAPH = args.calls_per_graph
    contexts, batches = args.contexts, args.batches
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    gpu = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    peak = peak_bandwidth(torch.empty(1, device="cuda"))  # what choose_launch reads (None: torch does not say)
    launch = pdl.enabled(torch.device("cuda"))  # the kernels' programmatic dependent launch (runtime/kernels/pdl.py)
    if not args.attention:
        report = {"gpu": gpu, "torch": torch.__version__, "dtype": "bfloat16", "copy_bandwidth_Bps": copy_bw,
                  "peak_bandwidth_Bps": peak, "calls_per_graph": CALLS_PER_GRAPH, "dependent_launch": launch}
        report.update(tables(args, copy_bw, g))
        write_text(args.out, json.dumps(report, indent=2))
        return 0
    shapes = [(b, t) for t in contexts for b in batches]
    rounds = [[bench_config(b, t, g) for b, t in shapes] for _ in range(args.rounds)]  # each round every shape
    rows = [derive(merge_rounds([r[i] for r in rounds]), copy_bw) for i in range(len(shapes))]
    report = {"gpu": gpu, "torch": torch.__version__, "dtype": "bfloat16", "heads": [HQ, HKV], "head_dim": D,
              "block": BLOCK, "kept_fraction": KEEP, "copy_bandwidth_Bps": copy_bw, "peak_bandwidth_Bps": peak,
              "launch": "engine (choose_launch)", "rounds": args.rounds,
              "calls_per_graph": CALLS_PER_GRAPH, "dependent_launch": launch, "rows": rows}
    report.update(tables(args, copy_bw, g))
    if args.sweep:
        report["tuning_ms"] = tune(g)
        report["sweep"] = {f"{t}x{b}": sweep(b, t, g) for t in contexts for b in batches}
        for shape, times in report["sweep"].items():
            best = sorted(times, key=times.get)[:3]
            print(f"sweep {shape}: " + ", ".join(f"{k} {times[k]:.4f} ms" for k in best)
                  + f" (t64cNonew4s2: {times.get('t64cNonew4s2', float('nan')):.4f})")

    print(f"{gpu}; copy {copy_bw / 1e12:.2f} TB/s; Hq {HQ} / Hkv {HKV} / D {D}, bf16, {BLOCK}-token blocks, "
          f"{KEEP:.0%} kept; rolecall's calls launched as the engine launches them; medians in ms")
    head = ("T", "B", "sdpa", "ours", "sp0", "sp4", "sp8", "sp8 x", "limit", "sp8 bw", "gather", "pages", "sel%",
            "fused", "fsel%", "FI dense", "FI sp8")
    print(" ".join(f"{h:>8}" for h in head))
    for r in rows:
        vals = (r["context"], r["batch"], r["sdpa_ms"], r["ours_dense_ms"], r["sparse_0_ms"], r["sparse_4_ms"],
                r["sparse_8_ms"], r["sparse_8_speedup_vs_sdpa"], r["sparse_8_byte_limit"],
                r["sparse_8_bandwidth_fraction"], r["gather_sdpa_ms"], r["page_scores_ms"],
                100 * r["selection_overhead"], r["decode_and_score_ms"], 100 * r["selection_overhead_fused"],
                r.get("flashinfer_dense_ms", float("nan")), r.get("flashinfer_sparse_ms", float("nan")))
        print(" ".join(f"{v:>8}" if isinstance(v, int) else f"{v:>8.3f}" for v in vals))
    write_text(args.out, json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
