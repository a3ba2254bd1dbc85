"""Calibration cost on a DS-Qwen-14B-shaped model: rolecall's streaming recorder against the plain forward pass
and against asking transformers for ``output_attentions=True`` (eager attention).

Random bf16 weights with the real shapes (Qwen2, 48 layers, hidden 5120, 40 query / 8 KV heads, head_dim 128,
intermediate 13824, vocab 152064); random token traces. Timings are per trace (one forward of the whole trace),
CUDA-synchronised, the first trace of each phase is a warm-up and left out; the table shows medians.

    python -m benchmarks.calibrate --out "$OUT"             # GPU: 32 traces × 8K tokens
    python -m benchmarks.calibrate --shape tiny --traces 3  # CPU smoke run
    python -m benchmarks.calibrate --end-to-end --out "$OUT"  # the whole calibrate-delta run, phase by phase

``--end-to-end`` times what ``calibrate-delta`` does with generated traces, phase by phase: load (here: building
the random-weight model on the device), generation on the engine (``rolecall.calibrate.traces``: ``--traces`` prompts of
``--prompt-tokens`` random ids, each forced to ``--length`` tokens, no EOS), recording and selection
(``calibrate.run``, the shipped settings' stride and pages) and writing the manifest. Beside the engine's
generation, in the same run: transformers ``model.generate`` on one batch of 8 of the same prompts for
``--hf-steps`` new tokens, projected to all the traces (batches × new tokens × its time per step; a lower bound,
since its later steps read more context). JSON: ``calibrate_end_to_end.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from benchmarks.report import at_least
from rolecall.calibrate.config import resolve
from rolecall.calibrate.recorder import AttentionRecorder, record_traces
from rolecall.cli import Parser
from rolecall.core.atomic import write_text

SHAPES = {
    "qwen-14b": dict(num_hidden_layers=48, hidden_size=5120, num_attention_heads=40, num_key_value_heads=8,
                     head_dim=128, intermediate_size=13824, vocab_size=152064),
    "tiny": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                 intermediate_size=512, vocab_size=1024),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def build(shape: str, device, dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def timed_forwards(model, traces, device, fn, budget_s: float) -> tuple[list[float], int]:
    times, start = [], time.perf_counter()
    for ids in traces:
        sync(device)
        t0 = time.perf_counter()
        fn(ids)
        sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return times, len(times)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=Path(__file__).name, description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen-14b")
    p.add_argument("--traces", type=int, default=32)
    p.add_argument("--length", type=int, default=8192, help="tokens per trace")
    p.add_argument("--stride", type=int, default=64)
    p.add_argument("--min-context", type=int, default=1024)
    p.add_argument("--query-block", type=int, default=32)
    p.add_argument("--budget-s", type=float, default=240.0, help="stop a phase after this many seconds and scale")
    p.add_argument("--baseline-lengths", default=None,
                   help="eager output_attentions lengths to try, comma-separated, each at most --length (default: "
                        "--length, a half and a quarter of it)")
    p.add_argument("--end-to-end", action="store_true", help="time the whole calibrate-delta run phase by phase, "
                   "generation on the engine and transformers' projected beside it")
    p.add_argument("--prompt-tokens", type=int, default=256, help="--end-to-end: tokens of each prompt")
    p.add_argument("--hf-steps", type=int, default=128, help="--end-to-end: transformers generate steps timed")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    at_least(p, args, prompt_tokens=1, hf_steps=1)
    if args.end_to_end and args.prompt_tokens >= args.length:
        p.error(f"--prompt-tokens must be below --length ({args.length}): the rest of each trace is generated, got "
                f"{args.prompt_tokens}")
    p.check_writable(args.out, "--out", folder=True)  # written after the timing: refused now if it cannot be
    at_least(p, args, traces=1, length=1, stride=1, min_context=0, query_block=1)
    if args.min_context >= args.length:
        p.error(f"--min-context must be below --length ({args.length}): queries are recorded from that position on, "
                f"got {args.min_context}")
    if not args.budget_s > 0:
        p.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    if args.baseline_lengths is None:
        args.baseline_lengths = [n for n in (args.length, args.length // 2, args.length // 4) if n]
    else:
        given = args.baseline_lengths
        args.baseline_lengths = p.counts(given, "--baseline-lengths", "lengths")
        if max(args.baseline_lengths) > args.length:
            p.error(f"--baseline-lengths takes lengths of at most --length ({args.length}) each, got {given!r}")
    return args


def end_to_end(args: argparse.Namespace, device, dtype, gpu: str) -> dict:
    """The phases of a ``calibrate-delta`` run with generated traces (see the module's docstring), in seconds."""
    import tempfile

    from rolecall import calibrate
    from rolecall.calibrate.api import save
    from rolecall.calibrate.traces import _on_engine

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    model = build(args.shape, device, dtype)
    sync(device)
    times["load"] = time.perf_counter() - t0
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    prompts = [torch.randint(100, vocab - 100, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.traces)]
    new = args.length - args.prompt_tokens
    t0 = time.perf_counter()
    traces = _on_engine(model, prompts, max_new_tokens=new, sample=False, temperature=1.0, top_p=1.0, seed=0,
                        eos=set(), pad=0, progress=True)
    sync(device)
    times["generation"] = time.perf_counter() - t0
    assert all(len(t) == args.length for t in traces), "a trace stopped short of --length"
    batch = prompts[:8]
    ids = torch.tensor(batch, device=device)
    steps = min(args.hf_steps, new)
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
        sync(device)
    hf_step = (time.perf_counter() - t0) / steps
    hf_projected = -(-args.traces // len(batch)) * new * hf_step
    config = {"stride": args.stride, "min_context": args.min_context, "query_block": args.query_block,
              "num_pages": 64, "recent_pages": 8, "chunk_size": min(args.length, 4096), "plots": False,
              "num_delta": min(3, model.config.num_hidden_layers - 3)}  # the tiny shape has 2 layers to select from
    manifest = calibrate.run(model, None, traces, config, progress=False, times=times)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        save(manifest, Path(tmp) / "m.delta.safetensors", plots=False)
    times["writing"] = time.perf_counter() - t0
    total = sum(times.values())
    result = {"gpu": gpu, "torch": torch.__version__, "shape": args.shape, "dtype": str(dtype), "traces": args.traces,
              "length": args.length, "prompt_tokens": args.prompt_tokens, "phases_s": times, "total_s": total,
              "transformers_generate": {"batch": len(batch), "steps_timed": steps, "s_per_step": hf_step,
                                        "projected_s": hf_projected,
                                        "projected_over_engine": hf_projected / times["generation"]},
              "delta_layers": manifest.delta_layers}
    print(f"{gpu}, {args.shape}, calibrate-delta end to end: {args.traces} traces of {args.length} tokens "
          f"({args.prompt_tokens} prompt + {new} generated)")
    for name, seconds in times.items():
        print(f"  {name:<11} {seconds:8.1f} s")
    print(f"  {'total':<11} {total:8.1f} s")
    print(f"  transformers generate, the same traces: {hf_projected:.1f} s projected ({hf_step * 1e3:.1f} ms a step "
          f"over its first {steps} steps at batch {len(batch)}), {hf_projected / times['generation']:.1f}x the "
          "engine's generation")
    return result


def shipped_recorder(cfg, args) -> tuple[Any, AttentionRecorder]:
    """The shipped calibration settings with the flags' stride, first context and query block, and a recorder
    made with them for a model of config ``cfg``."""
    config = resolve({"stride": args.stride, "min_context": args.min_context, "query_block": args.query_block,
                      "chunk_size": args.length})
    return config, AttentionRecorder(cfg.num_hidden_layers, cfg.num_attention_heads, stride=config.stride,
                                     min_context=config.min_context, page_size=config.page_size,
                                     num_pages=config.num_pages, recent_pages=config.recent_pages,
                                     bins=config.bins, query_block=config.query_block)


def output_attentions_baseline(model, trace: list[int], lengths: list[int], device: torch.device) -> list[dict]:
    """transformers' own way to read attention: one eager forward with ``output_attentions=True`` over the first
    ``length`` tokens of ``trace`` for each length: seconds and peak memory, or ``out of memory``."""
    baseline = []
    for length in lengths:
        model.set_attn_implementation("eager")
        reset_peak(device)
        entry = {"length": length}
        try:
            sync(device)
            t1 = time.perf_counter()
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([trace[:length]], device=device), use_cache=False,
                            logits_to_keep=1, output_attentions=True)
                probs_gib = sum(a.numel() * a.element_size() for a in out.attentions) / 2**30
                del out
            sync(device)
            entry.update(status="ok", seconds=time.perf_counter() - t1, peak_gib=peak_gib(device), attentions_gib=probs_gib)
        except torch.OutOfMemoryError:
            entry.update(status="out of memory", peak_gib=peak_gib(device))
        finally:
            model.set_attn_implementation("sdpa")
            torch.cuda.empty_cache() if device.type == "cuda" else None
        baseline.append(entry)
    return baseline


def print_table(result: dict, baseline: list[dict], args, gpu: str, weights_gib: float) -> None:
    """Seconds a trace and peak memory: the plain forward, rolecall's recorder and the eager baseline."""
    rows = [("phase", "median s/trace", "traces timed", f"est. {args.traces} traces s", "peak GiB")]
    for name in ("plain", "rolecall"):
        r = result[name]
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        rows.append((name, f"{r['median_s']:.3f}", str(r["measured"]), f"{r['median_s'] * args.traces:.1f}", peak))
    for b in baseline:
        secs = f"{b['seconds']:.3f}" if "seconds" in b else b["status"]
        peak = f"{b['peak_gib']:.1f}" if b.get("peak_gib") is not None else "-"
        rows.append((f"eager+output_attentions @{b['length']}", secs, "1", "-", peak))
    width = [max(len(r[i]) for r in rows) for i in range(5)]
    print(f"{gpu}, {args.shape}, {args.traces} traces × {args.length} tokens, weights {weights_gib:.1f} GiB")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.end_to_end:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_text(Path(args.out) / "calibrate_end_to_end.json", json.dumps(end_to_end(args, device, dtype, gpu),
                                                                           indent=2) + "\n")
        return 0
    t0 = time.perf_counter()
    model = build(args.shape, device, dtype)
    build_s = time.perf_counter() - t0
    weights_gib = sum(x.numel() * x.element_size() for x in model.parameters()) / 2**30
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    # one extra trace: the warm-up of each phase
    traces = [torch.randint(0, cfg.vocab_size, (args.length,), generator=g).tolist() for _ in range(args.traces + 1)]
    result = {"gpu": gpu, "torch": torch.__version__, "shape": args.shape, "model": SHAPES[args.shape],
              "dtype": str(dtype), "traces": args.traces, "length": args.length, "stride": args.stride,
              "min_context": args.min_context, "weights_gib": weights_gib, "build_s": build_s}

    def plain(ids):
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1)

    plain(traces[0][:512])
    reset_peak(device)
    times, n = timed_forwards(model, traces, device, plain, args.budget_s / 4)
    result["plain"] = {"median_s": statistics.median(times[1:] or times), "measured": n, "peak_gib": peak_gib(device)}

    config, recorder = shipped_recorder(cfg, args)

    def rec(ids):
        record_traces(model, [ids], recorder, chunk_size=config.chunk_size, progress=False)

    reset_peak(device)
    wall0 = time.perf_counter()
    times, n = timed_forwards(model, traces, device, rec, args.budget_s)
    wall = time.perf_counter() - wall0
    med = statistics.median(times[1:] or times)
    result["rolecall"] = {
        "median_s": med, "measured": n, "wall_s": wall, "peak_gib": peak_gib(device),
        "sampled_queries": int(recorder.totals.recall_count.item()),
        "estimate_32_traces_s": med * 32,
        "overhead_vs_plain": med / result["plain"]["median_s"],
    }

    baseline = output_attentions_baseline(model, traces[1], args.baseline_lengths, device)
    result["baseline_output_attentions"] = baseline

    print_table(result, baseline, args, gpu, weights_gib)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibrate_benchmark.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
