"""``calibrate-delta`` (also ``rolecall calibrate``): record attention on reasoning traces, choose DELTA's
Δ-layers and Lethe's budgets, write one role manifest, its config and plots.

Settings come in layers: the defaults of ``CalibrateConfig``, then ``--config`` (by default
``configs/calibrate/<model>.yaml`` when one ships for the model), then the flags given here.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rolecall.cli import script_parser


def _real(low: float, high: float | None, example: str, low_closed: bool = False):
    """The argparse type of a float flag: a finite number above ``low`` (or at it, with ``low_closed``) and at most
    ``high``, else a usage error in one line naming the value, the range and an example (nan and inf never pass)."""
    span = f"{'[' if low_closed else '('}{low:g}, {'∞)' if high is None else f'{high:g}]'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value >= low if low_closed else value > low
        if not (math.isfinite(value) and above and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number in {span}; pass e.g. {example}")
        return value

    parse.__name__ = "float"
    return parse

# flag -> (config key, type, help); every flag defaults to None so that an unset flag leaves the YAML value alone
_FLAGS: list[tuple[str, str, Callable[[str], object], str]] = [
    ("--model", "model", str, "model alias (configs/models/), Hugging Face id or local folder [smollm2-135m]"),
    ("--output", "output", str, "manifest path [artifacts/<model>.delta.safetensors]"),
    ("--traces", "traces", str, "JSONL file of traces ({\"text\"} or {\"ids\"} per line); skips generation"),
    ("--prompts", "prompts", str, "reasoning prompt source: champ, arithmetic[:N] or jsonl:PATH [champ]"),
    ("--num-prompts", "num_prompts", int, "prompts to generate traces from"),
    ("--max-new-tokens", "max_new_tokens", int, "tokens generated per trace"),
    ("--temperature", "temperature", _real(0, None, "0.6"), "sampling temperature (with --sample)"),
    ("--top-p", "top_p", _real(0, 1, "0.95"), "nucleus sampling mass (with --sample)"),
    ("--seed", "seed", int, "seed for sampled traces"),
    ("--max-traces", "max_traces", int, "use at most this many traces"),
    ("--stride", "stride", int, "record every stride-th query position"),
    ("--min-context", "min_context", int, "first recorded query position"),
    ("--chunk-size", "chunk_size", int, "prefill chunk in tokens"),
    ("--query-block", "query_block", int, "sampled rows materialised at once"),
    ("--bins", "bins", int, "decode-time bins of the sparsity profile"),
    ("--page-size", "page_size", int, "DELTA page size P in tokens"),
    ("--num-pages", "num_pages", int, "DELTA K: pages a sparse layer reads, the recent ones included"),
    ("--recent-pages", "recent_pages", int, "DELTA L: most recent pages always kept"),
    ("--warmup", "warmup", int, "full warm-up layers [0, warmup); layer `warmup` is the first Δ-layer"),
    ("--num-delta", "num_delta", str, "Δ-layers including the first, or 'auto' (smallest set reaching --target-recall)"),
    ("--select", "select", str, "Δ-layer selector: peaks (shift peaks, DELTA) or recall (greedy on simulated recall)"),
    ("--min-gap", "min_gap", int, "minimum distance between shift peaks, in layers"),
    ("--target-recall", "target_recall", _real(0, 1, "0.9"), "recall goal for --num-delta auto"),
    ("--budget", "budget", _real(0, 1, "0.25"), "Lethe: mean fraction of the context a layer keeps"),
    ("--min-budget", "min_budget", _real(0, 1, "0.02", low_closed=True), "Lethe: smallest fraction any layer keeps"),
    ("--dtype", "dtype", str, "model dtype [the alias's]"),
    ("--device", "device", str, "cpu, cuda, cuda:N [cuda when available]"),
    ("--device-map", "device_map", str, "'auto' shards a model larger than one GPU"),
    ("--deepspeed", "deepspeed", str, "shard the model with this DeepSpeed ZeRO-3 JSON (path or name in "
     "configs/deepspeed/); usually set by `accelerate launch --config_file configs/accelerate/zero3.yaml`"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rolecall.core.models import DTYPES

    parser.add_argument("--config", help="YAML of settings [configs/calibrate/<model>.yaml when it exists]")
    shown = effective_defaults()
    for flag, key, kind, text in _FLAGS:
        choices = DTYPES if key == "dtype" else None
        if "[" not in text and shown.get(key) is not None:  # the value a run without the flag takes
            text = f"{text} [{shown[key]}]"
        parser.add_argument(flag, dest=key, type=kind, default=None, choices=choices, help=text)
    parser.add_argument("--sample", dest="sample", action="store_const", const=True, default=None,
                        help="sample traces instead of greedy decoding")
    parser.add_argument("--no-plots", dest="plots", action="store_const", const=False, default=None,
                        help="skip the PNG plots")
    parser.add_argument("--include-sliding", dest="include_sliding", action="store_const", const=True, default=None,
                        help="hybrid models: let sliding-window layers be recorded and chosen as Δ-layers")
    parser.add_argument("--random-weights", dest="random_weights", action="store_const", const=True, default=None,
                        help="the model's architecture (alias, folder or config.json) with random weights, built "
                        "sharded: for speed and memory measurements only; needs --traces of token ids")
    parser.add_argument("--no-cache", action="store_true", help="regenerate traces even when cached")
    parser.add_argument("--allow-long-context", action="store_true",
                        help="accept traces longer than the model's context (max_position_embeddings) with only a "
                        "warning: for a model whose RoPE you extended on purpose")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the model folder's own Python code (auto_map in config.json); off by default")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def effective_defaults() -> dict:
    """What a run without flags and ``--config`` takes for each setting: the dataclass's defaults, then the default
    model's shipped ``configs/calibrate/<model>.yaml`` (for ``--help``; read without importing torch)."""
    from dataclasses import fields

    from rolecall.calibrate.config import CalibrateConfig, read_yaml, shipped_config

    values = {f.name: f.default for f in fields(CalibrateConfig)}
    path = shipped_config(values["model"])
    if path is not None:
        values.update(read_yaml(path))
    return values


def resolve_config(args: argparse.Namespace):
    from rolecall.calibrate.config import read_yaml, resolve, shipped_config

    flags = {key: getattr(args, key) for _, key, _, _ in _FLAGS} | {"sample": args.sample, "plots": args.plots,
                                                                      "include_sliding": args.include_sliding,
                                                                      "random_weights": args.random_weights}
    path = args.config
    if path is None:
        default_model = flags["model"] or "smollm2-135m"
        shipped = shipped_config(default_model)
        path = str(shipped) if shipped else None
    doc = read_yaml(path) if path else {}
    return resolve(doc, flags), path


def _default_output(model: str) -> Path:
    name = Path(model).name if Path(model).expanduser().is_dir() else model.replace("/", "--")
    return Path("artifacts") / f"{name}.delta.safetensors"


def run(args: argparse.Namespace) -> int:
    import torch

    from rolecall.calibrate.api import check_layers
    from rolecall.calibrate.api import run as calibrate
    from rolecall.calibrate.traces import read_traces
    from rolecall.cli.common import (
        check_placement,
        check_sampling_flags,
        chosen_device,
    )
    from rolecall.core import distributed
    from rolecall.core.atomic import check_writable
    from rolecall.core.models import load_config, load_tokenizer

    start = time.perf_counter()
    config, config_path = resolve_config(args)
    if not config.traces:  # generated traces: a sampling flag without sampling would change nothing
        check_sampling_flags(config.sample, {"--temperature": args.temperature, "--top-p": args.top_p,
                                             "--seed": args.seed}, "traces are greedy")
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    say(f"calibrate-delta: model {config.model}, config {config_path or 'defaults'}")
    _check_given_traces(config)
    prompts = None if config.traces else _prompts(config)  # a bad --prompts source: refused before anything loads
    output = Path(config.output) if config.output else _default_output(config.model)
    check_writable(output, "--output")  # written at the end: refused now if it cannot be
    wanted = chosen_device(config)  # a device this machine lacks: refused before anything loads
    check_placement("calibrate-delta", config.device_map, config.deepspeed)
    trust = args.trust_remote_code
    model_config = load_config(config.model, trust_remote_code=trust)
    selectable = check_layers(model_config, config)  # --warmup, --num-delta: against the model's layers, now
    launched = distributed.init_from_launcher()  # accelerate launch / torchrun: one process per GPU
    device = launched or torch.device(wanted)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    # token-id traces of a model given by its architecture alone need no tokenizer
    tokenizer = None if config.random_weights else load_tokenizer(config.model, trust_remote_code=trust)
    data = {}
    if config.traces:  # read before loading the model, so a bad file fails fast
        traces = read_traces(config.traces, tokenizer)
        data["source"] = f"file:{config.traces}"
        check_traces(traces[: config.max_traces], config, model_config, args.allow_long_context)
    else:
        check_prompt_lengths(prompts, tokenizer, config)
    model = distributed.load_frozen_model(config.model, dtype=config.dtype, device_map=config.device_map,
                                          random_weights=config.random_weights, deepspeed=config.deepspeed,
                                          device=None if config.device_map else device, trust_remote_code=trust)
    times = {"load": time.perf_counter() - start}
    if not config.traces:
        began = time.perf_counter()
        traces = _generate(model, tokenizer, prompts, config, data, args)
        times["generation"] = time.perf_counter() - began
    began = time.perf_counter()
    manifest = calibrate(model, tokenizer, traces, config, data=data, progress=not args.quiet, times=times)
    cost = _cost(time.perf_counter() - began, len(traces), device)
    if distributed.is_main():
        _write_and_report(manifest, output, config, selectable, cost, start, times, say)
    return 0


def _check_given_traces(config) -> None:
    """ZeRO-3 and random weights calibrate given traces only: refused in one line without ``--traces``."""
    from rolecall.core import distributed

    sharded = distributed.zero_stage(distributed.deepspeed_config(config.deepspeed)) >= 3
    if (sharded or config.random_weights) and not config.traces:
        why = ("every process must run the same forwards, and generations differ in length" if sharded
               else "a model with random weights generates no reasoning")
        raise ValueError(f"{'ZeRO-3' if sharded else '--random-weights'} calibrates given traces only ({why}); "
                         "pass --traces FILE of token ids")


def _write_and_report(manifest, output: Path, config, selectable: int, cost: str, start: float,
                      times: dict[str, float], say) -> None:
    """Write the manifest and its plots, then print what was chosen, what it cost and the wall time by phase (a
    warning first when ``--num-delta auto`` made most selectable layers Δ-layers)."""
    from rolecall.calibrate.api import save
    from rolecall.cli.common import wall_time_line

    began = time.perf_counter()
    for path in save(manifest, output, plots=config.plots):
        say(f"wrote {path}")
    times["writing"] = time.perf_counter() - began
    m = manifest.metrics
    if config.num_delta == "auto" and 2 * len(m["delta_layers"]) > selectable:
        print(f"calibrate-delta: warning: --num-delta auto chose {len(m['delta_layers'])} of the {selectable} "
              f"selectable layers as Δ-layers to reach --target-recall {config.target_recall}; Δ-layers run full "
              "attention, so little of the model stays sparse; pass a lower --target-recall or a fixed --num-delta",
              file=sys.stderr)
    print(f"Δ-layers {m['delta_layers']} ({config.select}); simulated recall of the sparse layers "
          f"{m['recall_mean']:.4f} at K={config.num_pages} pages ({config.recent_pages} recent) of {config.page_size}; "
          f"{manifest.data['traces']} traces, {manifest.data['tokens']} tokens, {m['sampled_queries']} sampled queries")
    print(cost)
    print(wall_time_line("calibrate-delta", time.perf_counter() - start, times))


def _prompts(config) -> list[str]:
    """The prompts of ``--prompts``, or a one-line refusal naming the flag."""
    from rolecall.calibrate.traces import load_prompts

    try:
        prompts = load_prompts(config.prompts, config.num_prompts)
    except ValueError as e:  # the message names the source and the fix
        raise ValueError(f"--prompts: {e}") from None
    if not prompts:
        raise ValueError(f"--prompts {config.prompts}: no prompts there; pass a source that has some")
    return prompts


def _generate(model, tokenizer, prompts: list[str], config, data: dict, args: argparse.Namespace) -> list[list[int]]:
    """Greedy (or sampled) reasoning traces of the model itself; rank 0 generates and caches, the others read."""
    import torch

    from rolecall.calibrate.traces import generate_traces
    from rolecall.core import distributed

    gen = dict(max_new_tokens=config.max_new_tokens, sample=config.sample, temperature=config.temperature,
               top_p=config.top_p, seed=config.seed, cache=not args.no_cache, progress=not args.quiet)
    several = distributed.world_size() > 1
    if several and not distributed.is_main():
        torch.distributed.barrier()  # rank 0 generates and caches first, the others read its cache
    traces = generate_traces(model, tokenizer, prompts, **gen)
    if several and distributed.is_main():
        torch.distributed.barrier()
    data.update({"source": f"generated:{config.prompts}", "prompts": len(prompts),
                 "generation": {k: gen[k] for k in ("max_new_tokens", "sample", "seed")}})
    return traces


def _cost(seconds: float, traces: int, device) -> str:
    """One line of what recording cost: seconds per trace and, on GPUs, the peak memory of the busiest process."""
    import torch

    from rolecall.core import distributed

    world = distributed.world_size()
    gpus = range(torch.cuda.device_count()) if device.type == "cuda" else []  # --device-map spreads over several
    peak = max((torch.cuda.max_memory_allocated(i) / 2**30 for i in gpus), default=0.0)
    peaks = distributed.per_process([peak])[:, 0]
    line = (f"recorded {traces} traces in {seconds:.1f} s: {seconds * world / max(traces, 1):.2f} s per trace per "
            f"process, {world} process{'es' if world > 1 else ''}")
    return line + (f"; peak GPU memory {float(peaks.max()):.2f} GiB per process" if device.type == "cuda" else "")


def check_traces(traces: list[list[int]], config, model_config, allow_long: bool = False) -> None:
    """Refuse, in one line and before the model loads, a trace with a token id the model (its ``model_config``)
    has no embedding for or one longer than its context (only a warning with ``allow_long``)."""
    from rolecall.core.models import check_context, context_limit
    from rolecall.core.tokens import check_token_ids, vocab_size

    if not traces:
        return
    check_token_ids(traces, vocab_size(model_config), f"trace {{n}} of {config.traces}")
    longest = max(range(len(traces)), key=lambda i: len(traces[i]))
    check_context(len(traces[longest]), context_limit(model_config, config.model),
                  f"trace {longest + 1} of {config.traces}", "cut it or pass shorter traces", allow_long,
                  "calibrate-delta")
    check_min_context(config, len(traces[longest]), f"the longest trace of {config.traces} (trace {longest + 1}) has",
                      "longer traces")


def check_prompt_lengths(prompts: list[str], tokenizer, config) -> None:
    """Refuse, before the model loads, a ``min_context`` that no trace generated from ``prompts`` can reach: the
    longest chat-formatted prompt plus ``max_new_tokens``, the most a trace can hold."""
    from rolecall.data.reasoning import format_prompt

    if tokenizer is None or not prompts:
        return
    longest = max(len(tokenizer(format_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]) for p in prompts)
    check_min_context(config, longest + config.max_new_tokens,
                      f"the traces of --prompts {config.prompts} (the longest prompt, {longest} tokens, and "
                      f"--max-new-tokens {config.max_new_tokens}) have at most", "a larger --max-new-tokens")


def check_min_context(config, most: int, what: str, longer: str) -> None:
    """Refuse a ``min_context`` at or past ``most`` tokens, the longest a trace is (``what`` says which it is;
    ``longer``: the other way out): recording samples query positions from ``min_context`` on, so it would record
    nothing, and say so only after all the work."""
    if config.min_context >= most:
        raise ValueError(f"--min-context {config.min_context} records nothing: {what} {most} tokens, and recording "
                         f"starts at position {config.min_context}; pass --min-context below {most}, or {longer}")


def build_parser() -> argparse.ArgumentParser:
    return script_parser("calibrate-delta", __doc__.split("\n\n")[0].replace("``", ""), add_arguments)


def main(argv: list[str] | None = None) -> int:
    from rolecall.cli import run_reporting_errors

    return run_reporting_errors("calibrate-delta", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
