"""Serving load through the HTTP API: the same stream of requests sent to ``rolecall serve`` under each policy.

    python -m benchmarks.serve --concurrency 64 --duration 300        # DS-Qwen-7B shaped, random weights, 32K
    python -m benchmarks.serve --model smollm2-135m --concurrency 64 --duration 300 \\
        --prompt-tokens 2048:6144 --output-tokens 256:1024            # the embedded model, its shipped manifests

For each of ``--policies`` (``full`` first, the baseline) it starts ``rolecall serve`` on a free local port with
``--slots`` rows of ``--max-context`` tokens, waits for ``/health``, sends ``--warmup`` short requests (not
counted), runs the load, and stops the server with SIGTERM. The model is either a shape (``--shape``, a Qwen2
``config.json`` with random weights: speed does not depend on the values; ``--model …/config.json`` too), with
manifests made for it as ``benchmarks/decode.py`` makes them (delta: layers 0–1 full, Δ-layers 2, 14, 22 for 28
layers; lychee: ``--retrieval-heads`` of 7B's 112 KV heads, all of layer 0 and the rest spread at random, the
same share for other shapes), or a model the server loads (``--model NAME``) with the manifests given
(``--manifest-delta``, ``--manifest-lychee``) or shipped in ``artifacts/<name>/``. Sparse policies read
``--budget`` tokens of 16-token pages (delta, 8 of them the most recent) or blocks (lychee).

The load is ``--concurrency N`` clients, each sending its next request when its last ended, or Poisson arrivals at
``--rate R`` requests/s; for ``--duration S`` seconds (requests still running then are cut and their tokens so
far counted) or ``--requests N``. Request ``i`` is the same under every policy: ``--prompt-tokens`` and
``--output-tokens`` lengths (``N`` fixed, ``LOW:HIGH`` uniform whole numbers) from ``--seed``, a prompt of random
token ids away from the ends of the vocabulary, sent as ids with ``ignore_eos`` (exactly ``max_tokens`` new
tokens), greedy, streamed. ``--staggered-start`` (with ``--concurrency N``) starts the first N requests part-way
into their traces, so a closed load holds a steady load's spread of contexts once they are prefilled
(:meth:`benchmarks.load.Workload.request`). Times are the client's: TTFT is the first chunk with tokens; TPOT is
(last token − first token) / (tokens − 1) per request. The steady window leaves the ramp-up and the drain out: it starts when
every slot first decodes (or a tenth of the way in, if later) and ends a tenth before the end, or at the end when a
``--duration`` cuts the load. In it: output tokens/s (``steady/s``), and the steady TPOT, the median over requests
of their TPOT there. A request that fails (an HTTP error, a lost connection, fewer tokens than asked) is counted,
and the run goes on. ``/metrics`` is sampled once a second: requests running and waiting, slots in use, KV-cache
bytes, and the engine's seconds in decode steps and in prefills; over the steady window those give the server's
own time per step (``step``: prefills between steps left out) and the share of time it prefilled.

The byte bound is the fastest a decode step of the live batch can be: the weights read once plus the K/V bytes the
policy reads at each live request's context (its static step's ``reads``), over ``--bandwidth-tbs`` (default: a
device-to-device copy measured on the run's GPU, named in the JSON as ``bandwidth_source``); taken at one
tick a second in the steady window over the requests decoding then, its median is the ``bound`` column, and ``of
bound`` is that over the steady TPOT (a TPOT also carries the prefills the server runs between steps). After the
servers, on CUDA with random weights, each policy's static step (``benchmarks/decode.py``'s: CUDA-graph replays,
median of 30) is timed at its steady live batch and mean context, beside the steady TPOT and the server's step.
Output tokens/s is every token read during the load phase over its wall time; ``× full`` is that over full's in
the same run. JSON (``--out``, default ``benchmarks/results/serve_<model>_<gpu>.json``): the settings, the GPU,
and per policy the counts, throughput, percentiles, server samples summarised and the static step (no per-request
dump).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from benchmarks.decode import (
    RETRIEVAL_HEADS_7B,
    delta_manifest,
    recent_pages,
    scaled_retrieval_heads,
    spread_heads,
)
from benchmarks.load import (
    Lengths,
    Load,
    Run,
    Workload,
    httpx,
    live_batches,
    percentile,
    run_load,
    server_load,
    summarise,
    warm_up,
)
from benchmarks.report import host_cpu
from benchmarks.timing import copy_bandwidth, gpu_slug
from rolecall.cli import Parser
from rolecall.core.atomic import write_text
from rolecall.core.manifest import ModelIdentity, RoleManifest
from rolecall.runtime.engine import SHAPES, ModelShape
from rolecall.runtime.memory import ELEMENT_BYTES

ROOT = Path(__file__).resolve().parents[1]

POLICIES = ("full", "delta", "lychee")
HOST = "127.0.0.1"
PROG = Path(__file__).name
SHIPPED = {"delta": "{name}/{name}.delta.safetensors", "lychee": "{name}/heads-hardkuma.safetensors"}  # artifacts/


def policy_params(name: str, budget: int) -> dict[str, int]:
    """The ``-p`` parameters of each policy, as benchmarks/decode.py binds them."""
    return {"full": {}, "delta": {"budget": budget, "page_size": 16, "recent_pages": recent_pages(budget)},
            "lychee": {"budget": budget, "block_size": 16}}[name]


def qwen2_config(shape: ModelShape, positions: int) -> Any:
    """A Qwen2 config of ``shape`` (what the server builds random weights from) with ``positions`` RoPE positions."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, max_position_embeddings=positions, rms_norm_eps=shape.eps,
                       rope_theta=shape.rope_theta, tie_word_embeddings=shape.tied)


def shipped_manifest(model: str, policy: str) -> Path | None:
    """``artifacts/<name>/…`` for ``policy`` where this checkout ships one for ``model``."""
    path = ROOT / "artifacts" / SHIPPED[policy].format(name=Path(model).name)
    return path if path.is_file() else None


def random_weights(args: argparse.Namespace) -> bool:
    """A shape, a bare ``config.json`` or ``--random-weights`` (an alias's bundled config): random weights."""
    return args.model is None or args.model.endswith("config.json") or args.random_weights


# -- the model and its manifests -----------------------------------------------------------------------------------
@dataclass
class Target:
    """What every server serves: ``model`` (its ``--model``), with random weights or not, its config and shape, and
    per policy the manifest file and the bound policy whose static step gives the byte bound."""

    name: str
    model: str
    random: bool
    shape: ModelShape
    manifests: dict[str, str | None]
    steps: dict[str, Any]


def prepare(args: argparse.Namespace, folder: Path) -> Target:
    """The config (written to ``folder`` for ``--shape``) and each policy's manifest (made for the shape, written
    to ``folder``; or given or shipped), checked against the config as the server will check them."""
    from rolecall.core.models import load_config
    from rolecall.runtime.session import bound_policy

    random = random_weights(args)
    if args.model is None:
        shape = SHAPES[args.shape]
        config = qwen2_config(shape, max(32768, args.max_context))
        model, name = str(folder / "config.json"), args.shape
        config.to_json_file(model)
    else:
        config = load_config(args.model)
        shape = ModelShape.from_config(config)
        bare = args.model.endswith("config.json")
        model = str(Path(args.model).resolve()) if bare else args.model
        name = (Path(args.model).parent.name if bare else Path(args.model).name) or "model"
    manifests: dict[str, str | None] = {"full": None}
    identity = ModelIdentity(shape.layers, shape.heads, shape.kv_heads, shape.head_dim)
    if "delta" in args.policies:
        manifests["delta"] = args.manifest_delta
        if random:
            manifests["delta"] = str(delta_manifest(shape).save(folder / "delta.safetensors"))
    if "lychee" in args.policies:
        manifests["lychee"] = args.manifest_lychee
        if random:
            heads = spread_heads(shape.layers, shape.kv_heads, scaled_retrieval_heads(shape, args.retrieval_heads))
            lychee = RoleManifest(identity, head_role=heads.to(torch.int8))
            manifests["lychee"] = str(lychee.save(folder / "lychee.safetensors"))
    steps = {}
    for policy in args.policies:
        manifest = RoleManifest.load(manifests[policy]) if manifests[policy] else None
        steps[policy] = bound_policy(policy, manifest, config, **policy_params(policy, args.budget)).static_step(shape)
    return Target(name, model, random, shape, manifests, steps)


def bound_ms(shape: ModelShape, step: Any, contexts: list[int], element: int, bandwidth: float) -> float:
    """Milliseconds of the fastest decode step of a batch at ``contexts``: weights once, plus the K/V ``step`` reads
    per request, over ``bandwidth`` bytes/s."""
    nbytes = shape.weight_bytes(len(contexts), element)
    nbytes += sum(shape.kv_bytes(1, step.reads(shape, c), element) for c in contexts)
    return nbytes / bandwidth * 1e3


# -- one server ----------------------------------------------------------------------------------------------------
class ServerError(RuntimeError):
    """The server did not start, or stopped: the message says how, with its last lines of output."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_command(args: argparse.Namespace, target: Target, policy: str, port: int) -> list[str]:
    """``rolecall serve`` for ``policy`` on ``port``, run by this interpreter from this checkout."""
    cmd = [sys.executable, "-c", "import sys; from rolecall.cli import main; sys.exit(main())", "serve",
           "--model", target.model, "--policy", policy, "--host", HOST, "--port", str(port), "--slots",
           str(args.slots), "--max-context", str(args.max_context), "--device", args.device, "--dtype", args.dtype]
    if target.random:
        cmd.append("--random-weights")
    if not args.paged_kv:
        cmd.append("--no-paged-kv")
    if target.manifests[policy]:
        cmd += ["--manifest", target.manifests[policy]]
    for key, value in policy_params(policy, args.budget).items():
        cmd += ["-p", f"{key}={value}"]
    return cmd


class Server:
    """One ``rolecall serve`` process (its output to ``log``): :meth:`wait_ready` polls ``/health``; leaving the
    ``with`` block stops it with SIGTERM (SIGKILL after ``stop_timeout`` seconds)."""

    def __init__(self, command: list[str], port: int, log: Path, label: str, stop_timeout: float = 120.0) -> None:
        self.command, self.url, self.log, self.label = command, f"http://{HOST}:{port}", log, label
        self.stop_timeout = stop_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(self.command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc: Any) -> None:
        p = self.process
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def tail(self, lines: int = 3) -> str:
        """The server's last ``lines`` lines of output, on one line."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no output)"
        last = [" ".join(line.split())[:300] for line in text.splitlines() if line.strip()][-lines:]
        return " | ".join(last) or "(no output)"

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ``/health`` answered 200; :class:`ServerError` if the process ends or ``timeout`` passes."""
        start = time.perf_counter()
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"rolecall serve ({self.label}) exited with status {code} before it was ready: "
                                  f"{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                raise ServerError(f"rolecall serve ({self.label}) did not answer /health within {timeout:.0f} s "
                                  f"(--startup-timeout): {self.tail()}")
            time.sleep(0.5)

    def model_id(self, fallback: str) -> str:
        """The first model ``/v1/models`` lists (what requests name), else ``fallback``."""
        try:
            return httpx.get(f"{self.url}/v1/models", timeout=5.0).json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return fallback


def serve_and_load(args: argparse.Namespace, target: Target, policy: str, workload: Workload, folder: Path) -> dict:
    """Start the server for ``policy``, warm it up, run the load, stop it; the run's summary."""
    port = free_port()
    with Server(server_command(args, target, policy, port), port, folder / f"{policy}.log", f"--policy {policy}") as s:
        print(f"{policy}: starting rolecall serve on port {port}", flush=True)
        ready = s.wait_ready(args.startup_timeout)
        model = s.model_id(target.model)
        if args.warmup:
            warm = asyncio.run(warm_up(s.url, model, workload, args.warmup, args.request_timeout))
            bad = next((r for r in warm if not r.done), None)
            if bad is not None:
                raise ServerError(f"rolecall serve ({s.label}): a warm-up request failed ({bad.error}): {s.tail()}")
        print(f"{policy}: ready in {ready:.0f} s; load running", flush=True)
        load = Load(args.concurrency, args.rate, args.duration, args.requests, args.seed)
        run = asyncio.run(run_load(s.url, model, workload, load, args.request_timeout))
        if s.process.poll() is not None:
            print(f"{policy}: the server stopped during the load (status {s.process.returncode}): {s.tail()}",
                  file=sys.stderr, flush=True)
    row = {"policy": policy, "params": policy_params(policy, args.budget),
           "manifest": Path(target.manifests[policy]).name if target.manifests[policy] else None,
           "startup_s": ready, **summarise(run, rows=min(args.slots, args.concurrency or args.slots),
                                           cut=args.duration is not None)}
    window = tuple(row["steady_window_s"])
    row["server"] = server_load(run.samples, window)
    row["bound"] = byte_bound(args, target, policy, run, window, row["steady_tpot_ms"])
    return row


def byte_bound(args: argparse.Namespace, target: Target, policy: str, run: Run, window: tuple[float, float],
               steady: float | None) -> dict:
    """The live batch's byte bound at one tick a second in ``window``: its median over ticks with a live batch, the
    mean live batch, and the bound over the ``steady`` TPOT."""
    batches = [b for b in live_batches(run.records, run.wall, window) if b]
    element, bandwidth = ELEMENT_BYTES[args.dtype], args.bandwidth_tbs * 1e12
    bounds = [bound_ms(target.shape, target.steps[policy], b, element, bandwidth) for b in batches]
    tpot = percentile(bounds, 50)
    contexts = [c for b in batches for c in b]
    return {"tpot_ms": tpot, "live_batch": sum(map(len, batches)) / len(batches) if batches else None,
            "mean_context": sum(contexts) / len(contexts) if contexts else None,
            "ticks": len(batches), "fraction": tpot / steady if tpot and steady else None}


def static_steps(args: argparse.Namespace, target: Target, rows: list[dict]) -> None:
    """Beside each policy's load, in the same run once its server has stopped: ``benchmarks/decode.py``'s static
    step (CUDA-graph replays, median) of the same policy at the steady window's live batch (its mean, rounded) and
    mean context, on random weights of the shape; ``static_step`` in each row, with the steady TPOT and the
    server's own step time over it."""
    from benchmarks.decode import Bench, make_policy
    from rolecall.runtime.engine import Weights

    weights = Weights.random(target.shape, torch.device(args.device), getattr(torch, args.dtype))
    bench = Bench.with_defaults("cuda", args.bandwidth_tbs * 1e12)
    for row in rows:
        live, context = row["bound"]["live_batch"], row["bound"]["mean_context"]
        if not live or not context:
            continue
        batch, context = max(1, round(live)), int(context)
        policy = make_policy(row["policy"], target.shape, args.budget,
                             scaled_retrieval_heads(target.shape, args.retrieval_heads))
        ms = bench.measure_random(weights, policy, batch, context + bench.margin(), context, row["policy"])
        steady, server = row["steady_tpot_ms"], row["server"].get("step_ms")
        row["static_step"] = {"batch": batch, "context": context, "ms": ms,
                              "steady_tpot_over_step": steady / ms if steady else None,
                              "server_step_over_step": server / ms if server else None}
        print(f"{row['policy']}: static step at {batch} × {context}: {ms:.2f} ms; steady TPOT "
              f"{steady or float('nan'):.2f} ms, server step {server or float('nan'):.2f} ms", flush=True)
        torch.cuda.empty_cache()


# -- reporting -----------------------------------------------------------------------------------------------------
HEAD = ("policy", "done", "failed", "tok/s", "x full", "steady/s", "x full", "TTFT p50", "TTFT p99", "TPOT p50",
        "TPOT p99", "steady", "step", "bound", "of bound", "live", "slots", "KV GB")
# ms; steady/s: output tokens/s in the steady window; step: the server's own time per decode step there; live:
# requests decoding; slots, KV: the server's


def print_row(r: dict) -> None:
    def f(value: Any, fmt: str = ".1f", scale: float = 1.0) -> str:
        return "-" if value is None else format(value * scale, fmt)

    def steady(metric: dict | None) -> float | None:
        return metric and (metric["steady_mean"] if metric["steady_mean"] is not None else metric["mean"])

    slots, kv = steady(r["server"]["slots_in_use"]), steady(r["server"]["kv_cache_bytes"])
    vals = (r["policy"], r["requests"]["done"], r["requests"]["failed"], f(r["output_tokens_per_s"]),
            f(r.get("speedup_vs_full"), ".2f"), f(r["steady_output_tokens_per_s"]),
            f(r.get("steady_speedup_vs_full"), ".2f"), f(r["ttft_ms"]["p50"]), f(r["ttft_ms"]["p99"]),
            f(r["tpot_ms"]["p50"], ".2f"), f(r["tpot_ms"]["p99"], ".2f"), f(r["steady_tpot_ms"], ".2f"),
            f(r["server"].get("step_ms"), ".2f"), f(r["bound"]["tpot_ms"], ".3g"), f(r["bound"]["fraction"], ".0%"), f(r["bound"]["live_batch"]),
            f(slots), f(kv, ".2f", 1e-9))
    print(" ".join(f"{v:>9}" for v in vals), flush=True)


def build_parser() -> Parser:
    """The script's flags."""
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--policies", default="full,delta,lychee", help=f"comma-separated: {', '.join(POLICIES)}")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="a DeepSeek-R1-Distill-Qwen shape with random weights (default 7b unless --model)")
    p.add_argument("--model", default=None, help="a model the server loads (alias, Hugging Face id, folder), or a "
                   "config.json to serve with random weights")
    p.add_argument("--random-weights", action="store_true", help="--model NAME's config with random weights (an "
                   "alias's config is bundled: --model qwen-14b --random-weights runs offline)")
    p.add_argument("--manifest-delta", default=None, help="--model: delta's manifest (default: the shipped "
                   "artifacts/<name>/<name>.delta.safetensors)")
    p.add_argument("--manifest-lychee", default=None, help="--model: lychee's manifest (default: the shipped "
                   "artifacts/<name>/heads-hardkuma.safetensors)")
    p.add_argument("--budget", type=int, default=2048, help="tokens a sparse layer or head reads")
    p.add_argument("--retrieval-heads", type=int, default=RETRIEVAL_HEADS_7B,
                   help="lychee's retrieval KV heads for 7B (of 112); other shapes get the same share")
    p.add_argument("--concurrency", type=int, default=None, help="clients, each sending its next request when "
                   "its last ended")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests per second")
    p.add_argument("--duration", type=float, default=None, help="seconds of load per policy")
    p.add_argument("--requests", type=int, default=None, help="requests per policy")
    p.add_argument("--prompt-tokens", default="31744", help="N, or LOW:HIGH drawn uniformly (default 31744)")
    p.add_argument("--output-tokens", default="1024", help="N, or LOW:HIGH drawn uniformly (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="of the lengths, the prompts and the arrivals")
    p.add_argument("--staggered-start", action="store_true",
                   help="--concurrency: the first N requests start part-way into their traces (a uniform share of "
                        "each output moved into its prompt), so the rows hold a steady load's spread of contexts once "
                        "they are prefilled")
    p.add_argument("--slots", type=int, default=None, help="the server's rows (default --concurrency, or 64)")
    p.add_argument("--no-paged-kv", dest="paged_kv", action="store_false",
                   help="the server's --no-paged-kv: a contiguous KV cache of --slots × --max-context")
    p.add_argument("--max-context", type=int, default=None,
                   help="the server's tokens per row (default: the longest prompt and output)")
    p.add_argument("--warmup", type=int, default=2, help="short requests sent before each load, not counted")
    p.add_argument("--device", default=None, help="the server's: cuda or cpu (default cuda when there is one)")
    p.add_argument("--dtype", default=None, choices=tuple(ELEMENT_BYTES),
                   help="weights dtype (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--bandwidth-tbs", type=float, default=None,
                   help="memory bandwidth the byte bound is taken over, TB/s (default: a device-to-device copy measured "
                   "on the GPU of the run, named in the JSON; an H100 is not an H200)")
    p.add_argument("--no-static-step", dest="static_step", action="store_false",
                   help="skip the static step of each policy at its steady live batch, timed after the servers "
                        "(CUDA, random weights)")
    p.add_argument("--startup-timeout", type=float, default=1200.0, help="seconds a server may take to be ready")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds a request may wait for a chunk")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/serve_<model>_<gpu>.json)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (each refusal one line naming the flag); lengths as :class:`Lengths`, the baseline
    policy first, the server's rows, context and dtype filled in, the manifests of a real model found."""
    p = build_parser()
    args = p.parse_args(argv)
    args.policies = p.names(args.policies, "--policies", POLICIES)
    args.policies = sorted(args.policies, key=lambda name: name != "full")  # the baseline first
    _check_load(p, args)
    _check_model(p, args)
    p.check_writable(args.out, "--out")
    return args


def _check_load(p: Parser, args: argparse.Namespace) -> None:
    """One way to send requests and one to end, positive numbers, the length ranges, the server's size."""
    from rolecall.cli.common import chosen_device

    if (args.concurrency is None) == (args.rate is None):
        p.error("give one of --concurrency N (clients) or --rate R (Poisson arrivals per second)"
                f"{', not both' if args.concurrency is not None else ''}")
    if args.staggered_start and args.concurrency is None:
        p.error("--staggered-start staggers the first --concurrency requests; it needs --concurrency N, not --rate")
    if (args.duration is None) == (args.requests is None):
        p.error(f"give one of --duration S or --requests N{', not both' if args.duration is not None else ''}")
    for flag in ("concurrency", "requests", "slots", "budget"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    for flag in ("retrieval_heads", "warmup"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be at least 0, got {getattr(args, flag)}")
    for flag in ("rate", "duration", "bandwidth_tbs", "startup_timeout", "request_timeout"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            p.error(f"--{flag.replace('_', '-')} must be a positive number, got {value}")
    try:
        args.prompt_tokens = Lengths.parse(args.prompt_tokens, "--prompt-tokens")
        args.output_tokens = Lengths.parse(args.output_tokens, "--output-tokens")
        args.device = chosen_device(args)
    except ValueError as e:
        p.error(str(e))
    longest = args.prompt_tokens.high + args.output_tokens.high
    if args.max_context is None:
        args.max_context = longest
    elif args.max_context < longest:
        p.error(f"--max-context must hold the longest prompt and output ({longest} tokens), got {args.max_context}")
    args.slots = args.slots or args.concurrency or 64
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")


def _check_model(p: Parser, args: argparse.Namespace) -> None:
    """A shape (random weights) or a model, and the manifests the model's sparse policies read."""
    if args.model is not None and args.shape is not None:
        p.error(f"--shape {args.shape} and --model {args.model}: give one (a shape is served with random weights)")
    if args.random_weights and args.model is None:
        p.error("--random-weights goes with --model NAME (a --shape is served with random weights already)")
    args.shape = args.shape or (None if args.model else "7b")
    if random_weights(args):
        for policy in ("delta", "lychee"):
            if getattr(args, f"manifest_{policy}"):
                p.error(f"--manifest-{policy} goes with --model NAME; with random weights the manifests are made "
                        "for the shape")
        if args.model is not None and args.model.endswith("config.json") and not Path(args.model).is_file():
            p.error(f"--model {args.model}: no such file")
    else:
        for policy in ("delta", "lychee"):
            flag = f"--manifest-{policy}"
            given = getattr(args, f"manifest_{policy}")
            if given and not Path(given).is_file():
                p.error(f"{flag} {given}: no such file")
            if policy in args.policies and not given:
                shipped = shipped_manifest(args.model, policy)
                if shipped is None:
                    p.error(f"--policies {policy} with --model {args.model} needs {flag} FILE (this checkout ships "
                            f"no artifacts/{SHIPPED[policy].format(name=Path(args.model).name)})")
                setattr(args, f"manifest_{policy}", str(shipped))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    args.bandwidth_source = "--bandwidth-tbs" if args.bandwidth_tbs else f"a copy measured on the {gpu}"
    if not args.bandwidth_tbs:
        args.bandwidth_tbs = copy_bandwidth(args.device, 2**28 if args.device.startswith("cuda") else 2**24) / 1e12
    with tempfile.TemporaryDirectory(prefix="rolecall-serve-") as tmp:
        folder = Path(tmp)
        try:
            target = prepare(args, folder)
        except (ValueError, OSError, NotImplementedError) as e:
            print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        out = Path(args.out or ROOT / "benchmarks" / "results" / f"serve_{target.name}_{gpu_slug(gpu)}.json")
        workload = Workload(args.prompt_tokens, args.output_tokens, target.shape.vocab, args.seed,
                            staggered=args.concurrency if args.staggered_start else 0)
        load = f"{args.concurrency} clients" if args.concurrency else f"Poisson arrivals at {args.rate:g}/s"
        span = f"{args.duration:g} s" if args.duration else f"{args.requests} requests"
        print(f"{gpu}; byte bound over {args.bandwidth_tbs:.2f} TB/s; {target.name} "
              f"({'random weights, ' if target.random else ''}{args.dtype}); {load}, {span} per policy; prompts "
              f"{args.prompt_tokens}, outputs {args.output_tokens} tokens; {args.slots} slots of {args.max_context}",
              flush=True)
        rows = []
        for policy in args.policies:
            try:
                row = serve_and_load(args, target, policy, workload, folder)
            except ServerError as e:
                print(f"{PROG}: error: {e}", file=sys.stderr)
                return 2
            if rows and rows[0]["policy"] == "full" and rows[0]["output_tokens_per_s"]:
                row["speedup_vs_full"] = row["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]
                row["steady_speedup_vs_full"] = (row["steady_output_tokens_per_s"]
                                                 / rows[0]["steady_output_tokens_per_s"])
            rows.append(row)
            if len(rows) == 1:
                print(" ".join(f"{h:>9}" for h in HEAD), flush=True)
            print_row(row)
        if args.static_step and args.device.startswith("cuda") and target.random:
            static_steps(args, target, rows)
    settings = {k: (str(v) if isinstance(v, Lengths) else v) for k, v in vars(args).items() if k != "out"}
    for key in ("model", "manifest_delta", "manifest_lychee"):  # no machine's paths in the results
        if settings[key] and Path(settings[key]).exists():
            settings[key] = Path(settings[key]).name
    report = {"gpu": gpu, "host_cpu": host_cpu(), "torch": torch.__version__, "model": target.name,
              "random_weights": target.random, "shape": vars(target.shape), "bandwidth_Bps": args.bandwidth_tbs * 1e12,
              "bandwidth_source": args.bandwidth_source, "settings": settings, "policies": rows}
    write_text(out, json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
