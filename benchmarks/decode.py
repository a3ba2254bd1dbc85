"""End-to-end decode speed of rolecall's policies: one static decode step per token, replayed from a CUDA graph.

    python -m benchmarks.decode                     # the default grid, JSON to benchmarks/results/decode_<gpu>.json
    python -m benchmarks.decode --smoke --out x.json  # tiny shapes on the CPU: checks that it runs

Models are DS-Qwen-7B / DS-Qwen-1.5B shaped, Gemma-3-4B shaped (``gemma3-4b``, a hybrid model whose sliding
layers hold rings of their window) or Llama-3-8B shaped (``llama3-8b``: 8 KV heads); random bf16 weights: speed
does not depend on the values. For each model, context, batch, policy and budget it fills a static cache with
random keys and values (the prefill is not timed), captures :class:`rolecall.runtime.engine.StaticDecoder`'s step in a CUDA
graph, warms up, and times ``--steps`` replays with CUDA events: median time per output token (TPOT), tokens/s
(batch / TPOT) and the speed-up over ``full`` in the same run. Every row also gives its byte bound: the weights read once
plus the K/V bytes the policy must read, over the device-to-device copy bandwidth measured in the same run
(bytes read + written per second, as in ``benchmarks/kernels.py``), and the fraction of it achieved. Page
scores that Δ-layers write and read (4 bytes per head and token) are not counted. ``held MB`` (CUDA) is the memory
the policy's decoder takes beside the weights and the cache: its own buffers (lychee's sets and kept logits,
quest's page bounds), and nothing more, since every decoder reads the weights it was given.

Policies are the runtime's own (``rolecall.runtime.policies``, bound to manifests made for the shape): ``full``;
``delta`` (layers 0–1 full, Δ-layers 2, 14, 22, the rest read ``budget`` tokens of 16-token pages, 8 of them
the most recent); ``lychee`` (``--retrieval-heads`` of the 112 KV heads of 7B read everything, scaled for
other shapes; the others read ``budget`` tokens of 16-token blocks). Sparse policies are timed as they are (no
fallback); the table's ``crossover`` lines give the smallest measured context from which a sparse policy stays
faster than full — the data of ``runtime/engine/crossovers.json``. ``full-flashinfer`` is the peer: the engine's
dense step with FlashInfer's paged decode (``flashinfer-python``) as every layer's attention in place of rolecall's
kernel, everything else the same (``benchmarks/peers.py``); its ``× full`` below 1 means rolecall's step is faster.

``--real MODEL`` (e.g. ``smollm2-135m``) also times the path users run on a real model: ``rolecall decode``'s
``session.generate`` (engine: prefill, CUDA-graph steps) against transformers ``model.generate`` on the same
prompts, batch 1 and 16, tokens/s over ``--real-new`` generated tokens each, and the time to the first token (a
request for one new token: the prefill and its choice, on a session that served a request before, as a serving
process does); and prefill throughput of the engine against one transformers forward (SDPA causal attention) over
a ``--real-prefill``-token prompt.

The DELTA setting (``--delta-setting``, DS-Qwen-1.5B, batch 64, 1K budget, decoding from ``--delta-prompt``
tokens to 18K): TPOT of full and delta at ``--delta-samples`` evenly spaced lengths, each in a cache sized to
that length, integrated with the trapezoid rule over every generated token; delta runs full below
``--min-context`` (the fallback the runtime applies), and the raw delta total is given too.

Where a step's time goes (CUDA): ``--profile FILE`` appends each configuration's kernel table (five replays);
``--timeline FILE`` writes one replay's kernels in time order (name, stream, start, duration, grid) with the
step's GPU busy and idle time, which shows what runs beside what and where the step waits.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from benchmarks.peers import flashinfer_available
from benchmarks.report import at_least, host_cpu
from benchmarks.timing import copy_bandwidth, event_times, gpu_slug, step_timeline
from rolecall.cli import Parser
from rolecall.core.atomic import write_text
from rolecall.core.manifest import ModelIdentity, RoleManifest
from rolecall.runtime.engine import SHAPES, ModelShape, StaticCache, StaticDecoder, Weights
from rolecall.runtime.engine.cache import head_order_of
from rolecall.runtime.engine.crossovers import default_min_context
from rolecall.runtime.kernels import pdl
from rolecall.runtime.policies import get_policy

SMOKE_SHAPE = ModelShape(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)
RETRIEVAL_HEADS_7B = 32  # of 28 × 4 = 112 KV heads (LycheeDecode's target)
GIB = 2**30
POLICIES = ("full", "delta", "delta-refine", "lychee", "quest", "vattention", "lethe",
            "full-flashinfer")  # what make_policy builds
DENSE = ("full", "full-flashinfer")  # read every token: no budget, not in the crossovers


# -- policies ------------------------------------------------------------------------------------------------------
# Gemma 3 4B's text decoder: a hybrid model, five of every six layers with a 1,024-token window (rings in the
# engine's cache), the sixth with full attention and its own RoPE table
GEMMA3_4B = ModelShape(layers=34, hidden=2560, heads=8, kv_heads=4, head_dim=256, intermediate=10240, vocab=262208,
                       qkv_bias=False, qk_norm=True, norm_offset=1.0, sandwich=True, embed_scale=2560 ** 0.5,
                       activation="gelu_pytorch_tanh", scale=256 ** -0.5, tied=True,
                       windows=tuple(None if i % 6 == 5 else 1024 for i in range(34)),
                       rope_kinds=tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(34)))
# Llama-3-8B: 8 KV heads, so batch 8 is 64 rows of (sequence, KV head) in each attention call (at 32K × 8 its cache
# takes 34 GB; 128K × 8 does not fit one GPU)
LLAMA3_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256,
                       rope_theta=500000.0, eps=1e-5, qkv_bias=False)
MODELS = {**SHAPES, "gemma3-4b": GEMMA3_4B, "llama3-8b": LLAMA3_8B}


def _config(shape: ModelShape) -> SimpleNamespace:
    """What a policy's bind() reads of a config, for random weights (a hybrid shape's layer kinds too)."""
    sliding = shape.sliding_layers
    kinds = {"layer_types": ["sliding_attention" if i in sliding else "full_attention"
                             for i in range(shape.layers)]} if sliding else {}
    return SimpleNamespace(num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                           num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, hidden_size=shape.hidden,
                           **kinds)


def spread_heads(layers: int, kv_heads: int, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` retrieval heads ``[L, Hkv]``: all of layer 0, the rest at random (layer, head) places. About a
    quarter of them then have a retrieval head of the same index in the next layer, as in trained manifests, and
    so make no choice (rolecall.runtime.policies.lychee.passes_on)."""
    g = torch.Generator().manual_seed(seed)
    heads = torch.zeros(layers, kv_heads, dtype=torch.bool)
    heads[0] = True
    heads.view(-1)[kv_heads + torch.randperm((layers - 1) * kv_heads, generator=g)[:max(count - kv_heads, 0)]] = True
    return heads


def delta_manifest(shape: ModelShape) -> RoleManifest:
    """DELTA's roles for ``shape``: layers 0–1 full, three Δ-layers (2, 14, 22 for 28 layers), the rest sparse.
    A hybrid shape's sliding layers get role 0 (as calibration gives them) and its full-attention layers the
    roles in turn: the first full, then Δ and sparse alternating."""
    identity = ModelIdentity(shape.layers, shape.heads, shape.kv_heads, shape.head_dim)
    if shape.sliding_layers:
        attention = [i for i in range(shape.layers) if i not in shape.sliding_layers]
        roles = [0] * shape.layers
        for k, i in enumerate(attention[1:]):
            roles[i] = 1 if k % 2 == 0 else 2
    else:
        selection = (2, 14, 22) if shape.layers > 22 else tuple(range(2, shape.layers, 2))[:3]
        roles = [0 if i < 2 else 1 if i in selection else 2 for i in range(shape.layers)]
    return RoleManifest(identity, layer_role=torch.tensor(roles, dtype=torch.int8))


def policy_and_manifest(name: str, shape: ModelShape, budget: int, retrieval_heads: int):
    """A runtime policy (not bound) and the manifest made for ``shape`` it runs on (DELTA's Δ-layers for 7B;
    spread heads), or None."""
    identity = ModelIdentity(shape.layers, shape.heads, shape.kv_heads, shape.head_dim)
    if name == "full":
        policy, manifest = get_policy("full"), None
    elif name == "delta":
        policy = get_policy("delta", budget=budget, page_size=16, recent_pages=recent_pages(budget))
        manifest = delta_manifest(shape)
    elif name == "delta-refine":  # two-stage: the Δ-layers pick 4·K candidates, each sparse layer its own K
        policy = get_policy("delta", budget=budget, page_size=16, recent_pages=recent_pages(budget), refine=4)
        manifest = delta_manifest(shape)
    elif name == "lychee":
        heads = spread_heads(shape.layers, shape.kv_heads, retrieval_heads).to(torch.int8)
        policy = get_policy("lychee", budget=budget, block_size=16)
        manifest = RoleManifest(identity, head_role=heads)
    elif name == "quest":  # the baseline: per-page key bounds, selection in every layer from the third
        policy, manifest = get_policy("quest", budget=budget, page_size=16), None
    elif name == "vattention":  # DELTA + vAttention: the Δ-layers' scores rank heavy hitters, samples up to budget
        policy, manifest = get_policy("vattention", max_sample=budget), delta_manifest(shape)
    elif name == "lethe":  # the same budget in every layer
        policy, manifest = get_policy("lethe", budget=budget), None
    elif name == "full-flashinfer":  # the peer: the engine's dense step with FlashInfer's decode as its attention
        from benchmarks.peers import FlashInferFull

        policy, manifest = FlashInferFull(), None
    else:
        raise SystemExit(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return policy, manifest


def recent_pages(budget: int, page_size: int = 16) -> int:
    """DELTA's recent pages at ``budget`` tokens: 8, or every page where the budget holds fewer."""
    return min(8, -(-budget // page_size))


def make_policy(name: str, shape: ModelShape, budget: int, retrieval_heads: int):
    """The policy of :func:`policy_and_manifest`, bound to its manifest."""
    policy, manifest = policy_and_manifest(name, shape, budget, retrieval_heads)
    policy.bind(manifest, _config(shape))
    return policy


def scaled_retrieval_heads(shape: ModelShape, count_7b: int) -> int:
    """The 7B count of retrieval heads as the same share of another shape's KV heads (at least layer 0's)."""
    total = shape.layers * shape.kv_heads
    return max(shape.kv_heads, round(count_7b * total / (28 * 4)))


# -- one configuration ---------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, device: str, bandwidth: float) -> None:
        self.args, self.device, self.bandwidth = args, device, bandwidth
        self.graphs = device == "cuda"
        self.timelines: dict[str, dict] = {}  # --timeline: per configuration, one step's kernels in time order
        self.held: int | None = None  # bytes the last measured decoder holds beside the weights and the cache

    @classmethod
    def with_defaults(cls, device: str, bandwidth: float) -> Bench:
        """A bench timing as this script does by default (medians of 30 replays after 5, compiled), for the other
        scripts that put a static step beside their own figures."""
        return cls(SimpleNamespace(warmup=5, steps=30, compile=True, profile=None, timeline=None), device, bandwidth)

    def measure_random(self, weights: Weights, policy, batch: int, slots: int, start: int, name: str) -> float:
        """:meth:`measure` over a cache of its own, ``batch`` rows of ``slots``, filled with random keys and values."""
        cache = StaticCache(weights.shape, batch, slots, weights.device, weights.dtype)
        cache.fill_random()
        return self.measure(weights, policy, batch, slots, start, cache, name)

    def free_bytes(self) -> int:
        if self.device != "cuda":
            return 1 << 62
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]

    def measure(self, weights: Weights, policy, batch: int, slots: int, start: int,
                cache: StaticCache | None, name: str | None = None) -> float:
        """Median ms per step of ``policy`` with ``start`` valid tokens (the length grows by one per step)."""
        a = self.args
        # a step that sizes its own layers (lethe's compact buffers) gets a cache of its own, at a steady state
        static = policy.static_step(weights.shape)
        own = hasattr(static, "cache_slots")
        if cache is not None and not own:  # random contents are one state in any head order: the shared cache
            cache = copy.copy(cache)  # takes the order this policy stores its heads in (lychee's roles first)
            cache.head_order = head_order_of(static.head_order, weights.shape)
        before = torch.cuda.memory_allocated() if self.device == "cuda" else None
        dec = StaticDecoder(weights, policy, batch, slots, cache=None if own else cache, min_context=0,
                            compile=self.args.compile and self.device == "cuda", prompt_tokens=0 if own else None)
        if own:
            dec.cache.fill_random()
        dec.set_length(start)
        # what the policy's decoder adds (its buffers; a policy that stored the weights in its own order would
        # show them here), its own cache not counted
        own_cache = sum(t.numel() * t.element_size() for t in dec.cache.k + dec.cache.v) if own else 0
        self.held = None if before is None else torch.cuda.memory_allocated() - before - own_cache
        if self.graphs:
            dec.capture()
        ms = statistics.median(event_times(dec.step, reps=a.steps, warmup=a.warmup))
        if a.profile and self.graphs:
            self.profile(dec, f"{name or policy.name} B={batch} T={start}")
        if a.timeline and self.graphs:
            self.timeline(dec, f"{name or policy.name} B={batch} T={start}")
        del dec
        return ms

    def profile(self, dec: StaticDecoder, label: str) -> None:
        """Append the step's kernels, sorted by GPU time, to ``--profile`` (5 replays)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                dec.step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
        with open(self.args.profile, "a") as f:
            f.write(f"== {label} (5 steps)\n{table}\n")

    def timeline(self, dec: StaticDecoder, label: str) -> None:
        """Keep one replay's kernels in time order with the step's busy and idle time (``--timeline``)."""
        import tempfile

        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec.step()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as folder:
            trace = Path(folder) / "trace.json"
            prof.export_chrome_trace(str(trace))
            t = step_timeline(json.loads(trace.read_text())["traceEvents"])
        self.timelines[label] = t
        top = ", ".join(f"{n[:32]} {v['us']:.0f}" for n, v in list(t["by_name"].items())[:3])
        print(f"  timeline {label}: {t['wall_us']:.0f} µs, GPU busy {t['busy_us']:.0f} (idle {t['idle_us']:.0f}); "
              f"{len(t['kernels'])} kernels; most time: {top}", flush=True)

    def bound(self, shape: ModelShape, policy, batch: int, context: int) -> float:
        """Bytes one step must read: weights once, and the K/V the policy reads at ``context`` tokens."""
        reads = policy.static_step(shape).reads(shape, context)
        return shape.weight_bytes(batch) + shape.kv_bytes(batch, reads)

    def row(self, model: str, shape: ModelShape, policy, budget: int | None, batch: int, context: int,
            ms: float) -> dict:
        nbytes = self.bound(shape, policy, batch, context)
        limit_ms = nbytes / self.bandwidth * 1e3
        return {"model": model, "policy": policy.name, "budget": budget, "batch": batch, "context": context,
                "tpot_ms": ms, "tokens_per_s": batch / (ms / 1e3), "bytes": nbytes, "byte_limit_ms": limit_ms,
                "byte_limit_fraction": limit_ms / ms}

    def margin(self) -> int:
        return self.args.warmup + self.args.steps + 4 + (5 if self.args.profile else 0) + (1 if self.args.timeline else 0)

    def grid(self, model: str, shape: ModelShape, weights: Weights) -> list[dict]:
        a = self.args
        rows = []
        for context in a.contexts:
            for batch in a.batches:
                need = StaticCache.bytes_needed(shape, batch, context)
                work = 2 * batch * shape.heads * context * 4 + GIB  # kept logits, partials, activations
                free = self.free_bytes()
                if need + work > free:
                    reason = f"needs {(need + work) / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
                    print(f"skip {model} B={batch} T={context}: {reason}", flush=True)
                    rows.append({"model": model, "batch": batch, "context": context, "skipped": reason})
                    continue
                cache = StaticCache(shape, batch, context, self.device, weights.dtype)
                cache.fill_random()
                start = context - self.margin()
                full_ms = None
                for name in a.policies:
                    for budget in ([None] if name in DENSE else a.budgets):
                        if budget is not None and budget >= context:
                            continue  # reads the whole context anyway
                        policy = make_policy(name, shape, budget or 0, scaled_retrieval_heads(shape, a.retrieval_heads))
                        ms = self.measure(weights, policy, batch, context, start, cache, name)
                        r = self.row(model, shape, policy, budget, batch, context, ms)
                        r["policy"] = name  # the case asked for ("delta-refine" is the delta policy refining)
                        r["decoder_bytes"] = self.held
                        if name == "full":
                            full_ms = ms
                        if full_ms is not None:
                            full_bytes = self.bound(shape, make_policy("full", shape, 0, 0), batch, context)
                            r["speedup_vs_full"] = full_ms / ms
                            r["speedup_limit"] = full_bytes / r["bytes"]
                        rows.append(r)
                        print_row(r, flush=True)
                del cache
        return rows

    def delta_setting(self, weights: Weights, shape: ModelShape) -> dict:
        """Total decode time from the prompt to ``--delta-total`` tokens, full against delta."""
        a = self.args
        b, budget, first, last = a.delta_batch, a.delta_budget, a.delta_prompt, a.delta_total
        lengths = sorted({round(first + (last - first) * i / (a.delta_samples - 1)) for i in range(a.delta_samples)})
        delta = make_policy("delta", shape, budget, 0)
        samples = []
        for length in lengths:
            slots = length + self.margin()
            need = StaticCache.bytes_needed(shape, b, slots) + 2 * b * shape.heads * slots * 4 + GIB
            free = self.free_bytes()
            if need > free:
                reason = f"needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
                print(f"skip DELTA setting at {length}: {reason}", flush=True)
                return {"skipped": reason}
            cache = StaticCache(shape, b, slots, self.device, weights.dtype)
            cache.fill_random()
            full = make_policy("full", shape, 0, 0)
            full_ms = self.measure(weights, full, b, slots, length, cache)
            delta_ms = self.measure(weights, delta, b, slots, length, cache)
            del cache
            samples.append({"length": length, "full_ms": full_ms, "delta_ms": delta_ms,
                            "full_bytes": self.bound(shape, full, b, length),
                            "delta_bytes": self.bound(shape, delta, b, length)})
            print(f"  DELTA setting, length {length:>6}: full {full_ms:.3f} ms, delta {delta_ms:.3f} ms", flush=True)

        def integrate(key) -> float:
            """Σ over generated tokens (lengths first .. last-1) of a per-step quantity, by the trapezoid rule."""
            xs = [s["length"] for s in samples]
            ys = [key(s) for s in samples]
            return sum((xs[i + 1] - xs[i]) * (ys[i] + ys[i + 1]) / 2 for i in range(len(xs) - 1))

        threshold = a.min_context
        total_full = integrate(lambda s: s["full_ms"]) / 1e3
        total_delta_raw = integrate(lambda s: s["delta_ms"]) / 1e3
        total_delta = integrate(lambda s: s["full_ms"] if s["length"] < threshold else s["delta_ms"]) / 1e3
        bytes_full = integrate(lambda s: s["full_bytes"])
        bytes_delta = integrate(lambda s: s["full_bytes"] if s["length"] < threshold else s["delta_bytes"])
        tokens = b * (last - first)
        return {"model": "tiny" if a.smoke else "1.5b", "batch": b, "budget": budget, "prompt": first, "total": last,
                "min_context": threshold, "samples": samples, "integration": "trapezoid over sampled lengths",
                "full_s": total_full, "delta_s": total_delta, "delta_raw_s": total_delta_raw,
                "full_tokens_per_s": tokens / total_full, "delta_tokens_per_s": tokens / total_delta,
                "speedup": total_full / total_delta, "speedup_raw": total_full / total_delta_raw,
                "speedup_limit": bytes_full / bytes_delta,
                "byte_limit_fraction_full": bytes_full / self.bandwidth / total_full,
                "byte_limit_fraction_delta": bytes_delta / self.bandwidth / total_delta}


# -- a real model, through the path users run ----------------------------------------------------------------------
REAL_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when it performs badly.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for a vegetarian lasagna, step by step.",
    "Describe the water cycle to a ten-year-old.",
    "Summarise the plot of Hamlet in a few paragraphs.",
    "How do vaccines train the immune system?",
    "List some tips for writing clear technical documentation.",
]


def wall(fn, reps: int) -> float:
    """Median wall seconds of ``fn`` after one untimed call (each call synchronised)."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def real_model(args: argparse.Namespace) -> dict:
    from rolecall.core.models import load_model, load_tokenizer, pad_token
    from rolecall.runtime import attach
    from rolecall.runtime.engine import Weights as EngineWeights

    model = load_model(args.real, dtype=torch.bfloat16).to("cuda")
    tok = load_tokenizer(args.real)
    pad = pad_token(tok)
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             if tok.chat_template else p for p in REAL_PROMPTS]
    encoded = [tok(c, add_special_tokens=not tok.chat_template)["input_ids"] for c in chats]
    n = args.real_new
    name = Path(args.real).name if Path(args.real).exists() else args.real  # no machine's paths in the results
    rows = []
    for batch in (1, 16):
        prompts = [encoded[i % len(encoded)] for i in range(batch)]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
        common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad)
        first = dict(common, max_new_tokens=1)  # the time to the first token: the prefill and its choice
        hf_s = wall(lambda c=common: model.generate(**c, min_new_tokens=n), args.real_reps)
        hf_first_s = wall(lambda c=first: model.generate(**c), args.real_reps)
        with attach(model, None, "full") as session:
            ours_s = wall(lambda c=common, s=session: s.generate(**c, eos_token_id=-1), args.real_reps)
            last = session.last
            ours_first_s = wall(lambda c=first, s=session: s.generate(**c, eos_token_id=-1), args.real_reps)
        row = {"model": name, "batch": batch, "new_tokens": n, "prompt_tokens_max": width,
               "transformers_generate_s": hf_s, "transformers_tokens_per_s": batch * n / hf_s,
               "rolecall_generate_s": ours_s, "rolecall_tokens_per_s": batch * n / ours_s,
               "rolecall_decode_only_tokens_per_s": batch * last.steps / last.decode_s,
               "speedup": hf_s / ours_s, "transformers_first_token_s": hf_first_s,
               "rolecall_first_token_s": ours_first_s, "engine": last.info}
        rows.append(row)
        print(f"real {name} B={batch}: transformers generate {row['transformers_tokens_per_s']:.0f} tok/s, "
              f"rolecall {row['rolecall_tokens_per_s']:.0f} tok/s ({row['speedup']:.2f}×; decode steps alone "
              f"{row['rolecall_decode_only_tokens_per_s']:.0f} tok/s); first token {1e3 * hf_first_s:.1f} against "
              f"{1e3 * ours_first_s:.1f} ms", flush=True)
    # prefill: the engine's chunked prefill against one transformers forward (SDPA causal attention), per length
    prefill = []
    for p in args.real_prefill:
        ids = torch.randint(0, model.config.vocab_size, (1, p), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(0))
        weights = EngineWeights.from_model(model, positions=p + 8)

        def ours(p=p, ids=ids, weights=weights) -> None:
            StaticDecoder(weights, None, 1, p + 8).prefill(ids)

        with torch.no_grad():
            hf_s = wall(lambda ids=ids: model(ids, use_cache=False, logits_to_keep=1), args.real_reps)
        ours_s = wall(ours, args.real_reps)
        prefill.append({"model": name, "prompt_tokens": p, "transformers_sdpa_tokens_per_s": p / hf_s,
                        "rolecall_tokens_per_s": p / ours_s, "ratio": hf_s / ours_s})
        print(f"prefill {p} tokens: transformers (SDPA) {prefill[-1]['transformers_sdpa_tokens_per_s']:.0f} tok/s, "
              f"rolecall {prefill[-1]['rolecall_tokens_per_s']:.0f} tok/s", flush=True)
        del weights
    return {"generate": rows, "prefill": prefill}


def users_path(args: argparse.Namespace, model: str, shape: ModelShape, steps: list[dict],
               device: str = "cuda") -> list[dict]:
    """``--generate``: each (context, batch) of it through ``session.generate`` (what ``rolecall decode`` and the
    Python API run) on a transformers model of ``shape`` with random weights, for every policy and the first
    budget, beside the static step of the same configuration timed by the grid above.

    The prompt is ``context - new / 2`` tokens, so the mean length over the ``--generate-new`` decoded tokens is
    the grid's context. A request runs twice (the first compiles and captures); the second's decode time per step
    (``Generation.decode_s / steps``: graph replays, the host's checks and the tokens read back) is the TPOT, and
    ``generate / step`` its ratio to the static step's median."""
    from benchmarks.serve import qwen2_config
    from rolecall.core.distributed import random_model
    from rolecall.runtime import attach

    new, budget = args.generate_new, args.budgets[0]
    longest = max(context for context, _ in args.generate) + new
    hf = random_model(qwen2_config(shape, longest + 64), torch.bfloat16 if device == "cuda" else torch.float32, device)
    gen = torch.Generator(device).manual_seed(0)
    rows = []
    for context, batch in args.generate:
        ids = torch.randint(100, shape.vocab - 100, (batch, context - new // 2), device=device, generator=gen)
        for name in args.policies:
            if name == "full-flashinfer":
                continue
            spent = None if name in DENSE else budget
            policy, manifest = policy_and_manifest(name, shape, spent or 0, scaled_retrieval_heads(shape, args.retrieval_heads))
            times = []
            with attach(hf, manifest, policy, engine="static", min_context=0) as session:
                for _ in range(2):
                    session.generate(input_ids=ids, max_new_tokens=new, do_sample=False, eos_token_id=[])
                    times.append(session.last.decode_s / session.last.steps)
            step = next((r for r in steps if r.get("model") == model and r.get("batch") == batch and
                         r.get("context") == context and r.get("policy") == name and r.get("budget") == spent), None)
            row = {"model": model, "batch": batch, "context": context, "policy": name, "budget": spent,
                   "new_tokens": new, "generate_tpot_ms": 1e3 * times[-1], "first_request_tpot_ms": 1e3 * times[0],
                   "step_tpot_ms": step["tpot_ms"] if step else None}
            row["generate_over_step"] = row["generate_tpot_ms"] / row["step_tpot_ms"] if step else None
            rows.append(row)
            ratio = f"{row['generate_over_step']:.3f}" if step else "no step row"
            print(f"session.generate {model} B={batch} T={context} {name}: {row['generate_tpot_ms']:.3f} ms a token, "
                  f"static step {step['tpot_ms'] if step else float('nan'):.3f} ms: generate / step {ratio}", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    del hf
    return rows


# -- reporting -----------------------------------------------------------------------------------------------------
HEAD = ("model", "B", "T", "policy", "budget", "TPOT ms", "tok/s", "x full", "limit x", "bound ms", "of bound",
        "held MB")


def print_row(r: dict, flush: bool = False) -> None:
    vals = (r["model"], r["batch"], r["context"], r["policy"], r["budget"] or "-", f"{r['tpot_ms']:.3f}",
            f"{r['tokens_per_s']:.1f}", f"{r.get('speedup_vs_full', float('nan')):.2f}",
            f"{r.get('speedup_limit', float('nan')):.2f}", f"{r['byte_limit_ms']:.3f}",
            f"{100 * r['byte_limit_fraction']:.0f} %",
            "-" if r.get("decoder_bytes") is None else f"{r['decoder_bytes'] / 1e6:.1f}")
    print(" ".join(f"{v:>9}" for v in vals), flush=flush)


def crossovers(rows: list[dict]) -> list[dict]:
    """Per (model, batch, policy, budget): the smallest measured context from which the policy is faster than
    full at every measured context, or None."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "skipped" not in r and r["policy"] not in DENSE and "speedup_vs_full" in r:
            groups.setdefault((r["model"], r["batch"], r["policy"], r["budget"]), []).append(r)
    out = []
    for (model, batch, policy, budget), rs in sorted(groups.items(), key=str):
        rs.sort(key=lambda r: r["context"])
        wins = None
        for r in reversed(rs):
            if r["speedup_vs_full"] <= 1.0:
                break
            wins = r["context"]
        out.append({"model": model, "batch": batch, "policy": policy, "budget": budget, "faster_from": wins,
                    "contexts": [r["context"] for r in rs]})
    return out


def parse_pair(p: Parser, item: str) -> tuple[int, int]:
    """``CONTEXTxBATCH`` of ``--generate`` as two whole numbers, the context past ``--generate-new``."""
    context, _, batch = item.strip().lower().partition("x")
    if not (context.isdigit() and batch.isdigit() and int(batch) > 0 and int(context) > 0):
        p.error(f"--generate: {item!r} is not CONTEXTxBATCH (e.g. 32768x8)")
    return int(context), int(batch)


def build_parser() -> Parser:
    """The script's flags."""
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="7b,1.5b",
                   help="comma-separated: 7b, 1.5b, gemma3-4b, llama3-8b (the fixed-context grid)")
    p.add_argument("--contexts", default="4096,8192,16384,32768,131072")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--policies", default="full,delta,lychee", help="comma-separated: full, delta, delta-refine "
                   "(two-stage, 4·K candidates), lychee, quest, vattention (on DELTA's roles, samples up to the "
                   "budget), lethe, full-flashinfer (the peer: full with FlashInfer's dense decode as each "
                   "layer's attention)")
    p.add_argument("--budgets", default="2048", help="tokens read by sparse heads / layers")
    p.add_argument("--retrieval-heads", type=int, default=RETRIEVAL_HEADS_7B,
                   help="lychee retrieval KV heads for 7B (112 in all); other shapes get the same share")
    p.add_argument("--steps", type=int, default=30, help="timed replays per configuration")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--delta-setting", action=argparse.BooleanOptionalAction, default=True,
                   help="also time DELTA's setting: 1.5B, batch 64, decoding to 18K tokens")
    p.add_argument("--delta-batch", type=int, default=64)
    p.add_argument("--delta-budget", type=int, default=1024)
    p.add_argument("--delta-prompt", type=int, default=512, help="prompt length the decoding starts from")
    p.add_argument("--delta-total", type=int, default=18432, help="length the decoding ends at")
    p.add_argument("--delta-samples", type=int, default=7, help="lengths timed and integrated over")
    p.add_argument("--min-context", type=int, default=None,
                   help="below this length delta runs full in the DELTA-setting total (default: the runtime's "
                        "crossover for delta at --delta-batch, runtime/engine/crossovers.json)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="fuse each layer's small ops with torch.compile, as the engine does by default on CUDA")
    p.add_argument("--profile", default=None, help="append each configuration's kernel table to this file")
    p.add_argument("--timeline", default=None,
                   help="JSON file: each configuration's kernels of one step in time order (name, stream, start, "
                        "duration, grid), with the step's GPU busy and idle time (CUDA only)")
    p.add_argument("--real", default=None, help="also time generate and prefill on this real model (alias)")
    p.add_argument("--real-new", type=int, default=256, help="tokens generated per prompt in --real")
    p.add_argument("--real-prefill", type=int, nargs="+", default=[4096, 32768],
                   help="prompt lengths of the --real prefill timing (one row: the engine prefills up to 32,768 "
                        "tokens a chunk)")
    p.add_argument("--real-reps", type=int, default=3)
    p.add_argument("--generate", default=None, help="CONTEXTxBATCH,...: also time these configurations of the "
                   "first --models shape through session.generate, the path users run (e.g. 32768x8,131072x1)")
    p.add_argument("--generate-new", type=int, default=256, help="tokens each --generate request decodes")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no graphs (checks it runs)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_<gpu>.json)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (each refusal one line naming the flag), before anything is timed."""
    p = build_parser()
    args = p.parse_args(argv)
    args.contexts = p.counts(args.contexts, "--contexts", "context lengths")
    args.batches = p.counts(args.batches, "--batches", "batch sizes")
    args.budgets = p.counts(args.budgets, "--budgets", "token budgets")
    at_least(p, args, steps=1, warmup=0, retrieval_heads=0, delta_batch=1, delta_budget=1, delta_prompt=1,
             delta_samples=(2, "the first and the last length"), min_context=0, real_new=1, real_prefill=1,
             real_reps=1, generate_new=2)
    args.generate = [parse_pair(p, item) for item in args.generate.split(",")] if args.generate else []
    if args.generate and args.smoke:
        p.error("--generate times the engine on a GPU; --smoke runs on the CPU: leave one out")
    if args.delta_total <= args.delta_prompt:
        p.error(f"--delta-total must be past --delta-prompt ({args.delta_prompt}), got {args.delta_total}")
    args.models = p.names(args.models, "--models", MODELS, none_ok="--real" if args.real else None)
    args.policies = p.names(args.policies, "--policies", POLICIES)  # refused before anything is timed
    if "full-flashinfer" in args.policies and (args.smoke or not flashinfer_available()):
        p.error("--policies full-flashinfer needs flashinfer-python importable and a GPU (not --smoke); install "
                "flashinfer-python, or leave full-flashinfer out")
    if "full" in args.policies:
        args.policies = ["full"] + [x for x in args.policies if x != "full"]  # the baseline first
    if args.smoke:
        _smoke(args)
    if args.min_context is None:  # the fallback the runtime applies at the setting's batch
        args.min_context = default_min_context("delta", args.delta_batch, args.delta_budget)
    if args.smoke and args.timeline:
        p.error("--timeline records GPU kernels; --smoke runs on the CPU, so there is nothing to record")
    for flag in ("out", "profile", "timeline"):  # written after minutes of timing: refused now if they cannot be
        p.check_writable(getattr(args, flag), f"--{flag}")
    return args


def _smoke(args: argparse.Namespace) -> None:
    """``--smoke``: tiny shapes and few steps, so the CPU runs every path in seconds."""
    args.contexts = [c for c in args.contexts if c <= 256] or [64, 160]
    args.batches = [min(b, 2) for b in args.batches]
    args.budgets = [min(b, 32) for b in args.budgets]
    args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    args.delta_batch, args.delta_budget, args.delta_prompt, args.delta_total = 2, 32, 40, 160
    args.delta_samples, args.min_context = 3, 64


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        device, gpu, dtype = "cpu", "cpu", torch.float32
        shapes = {"tiny": SMOKE_SHAPE}
        delta_shape = SMOKE_SHAPE
        bandwidth = copy_bandwidth(device, 1 << 22)
    else:
        if not torch.cuda.is_available():
            print("benchmarks/decode.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
            return 2
        device, gpu, dtype = "cuda", torch.cuda.get_device_name(), torch.bfloat16
        shapes = {m: MODELS[m] for m in args.models}
        delta_shape = SHAPES["1.5b"]
        bandwidth = copy_bandwidth(device, 2**30)
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"decode_{gpu_slug(gpu)}.json")
    bench = Bench(args, device, bandwidth)
    print(f"{gpu}; copy {bandwidth / 1e12:.2f} TB/s; {'bf16' if dtype == torch.bfloat16 else 'fp32'}; "
          f"{'CUDA graphs' if bench.graphs else 'eager'}; medians of {args.steps} steps", flush=True)
    print(" ".join(f"{h:>9}" for h in HEAD), flush=True)
    rows: list[dict] = []
    for model, shape in shapes.items():
        weights = Weights.random(shape, device, dtype)
        rows += bench.grid(model, shape, weights)
        del weights
    setting = None
    if args.delta_setting:
        print(f"DELTA setting: {'tiny' if args.smoke else '1.5B'}, batch {args.delta_batch}, {args.delta_budget}-token budget, "
              f"{args.delta_prompt} → {args.delta_total} tokens", flush=True)
        weights = Weights.random(delta_shape, device, dtype)
        setting = bench.delta_setting(weights, delta_shape)
        del weights
    generated = users_path(args, args.models[0], shapes[args.models[0]], rows) if args.generate else []
    real = real_model(args) if args.real and not args.smoke else None
    cross = crossovers(rows)
    for c in cross:
        where = f"from {c['faster_from']} tokens" if c["faster_from"] else "at no measured context"
        print(f"crossover {c['model']} B={c['batch']} {c['policy']} (budget {c['budget']}): faster than full {where} "
              f"(measured {c['contexts']})")
    if setting and "skipped" not in setting:
        s = setting
        print(f"DELTA setting total: full {s['full_s']:.2f} s ({s['full_tokens_per_s']:.0f} tok/s), delta "
              f"{s['delta_s']:.2f} s ({s['delta_tokens_per_s']:.0f} tok/s, full below {s['min_context']}): "
              f"{s['speedup']:.2f}× (raw delta {s['speedup_raw']:.2f}×; byte limit {s['speedup_limit']:.2f}×; "
              f"{100 * s['byte_limit_fraction_delta']:.0f} % of the byte bound)")
    report = {"gpu": gpu, "host_cpu": host_cpu(), "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
              "copy_bandwidth_Bps": bandwidth, "cuda_graphs": bench.graphs,
              "dependent_launch": device == "cuda" and pdl.enabled(torch.device("cuda")),
              "args": {k: (Path(v).name if k in ("real", "profile", "timeline") and v and Path(v).exists() else v)
                       for k, v in vars(args).items() if k != "out"},
              "shapes": {m: vars(s) for m, s in shapes.items()}, "rows": rows, "crossovers": cross,
              "delta_setting": setting, "real": real, "generate": generated}
    write_text(out, json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    if args.timeline and bench.timelines:
        write_text(args.timeline, json.dumps({"gpu": gpu, "configurations": bench.timelines}, default=str) + "\n")
        print(f"wrote {args.timeline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
