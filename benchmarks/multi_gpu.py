"""Calibration and train-heads on 1 and 2 GPUs, launched the way users launch them, checked against each other.

Run on a machine with two GPUs, from the repository root:

    python -m benchmarks.multi_gpu --model smollm2-135m --out results/multi_gpu

It runs, each as its own command (``python -m rolecall.calibrate`` / ``python -m rolecall.train`` for one process,
``accelerate launch --config_file configs/accelerate/<name>.yaml -m ...`` for two):

1. ``calibrate``: the same traces calibrated by 1 process and by 2 (``multi_gpu.yaml``); the two manifests
   must hold the same Δ-layers, budgets and statistics.
2. ``ddp``: train-heads with a global batch of 2 on 1 GPU and on 2 (``multi_gpu.yaml``): losses, E[L0], λ
   and gates per step must agree; median seconds per step after the first ``--warmup`` steps.
3. ``zero3``: a DS-Qwen-14B-architecture model with random bf16 weights (speed and memory only), sharded
   over 2 GPUs by ZeRO-3 (``zero3.yaml``): steps complete, a checkpoint resumes on 2 processes and on 1,
   and both resumed runs continue the uninterrupted one; step time on 1 GPU (plain) vs 2 (ZeRO-3), and the
   peak memory per GPU for each prompt length of ``--prompt-lengths``.
4. ``large`` (not in the default ``--parts``): a DeepSeek-R1-Distill-Llama-70B-architecture model with random
   bf16 weights, built already sharded (ZeRO-3 ``zero.Init``; meta device for ``--device-map``): train-heads
   under ZeRO-3 over every visible GPU at each of ``--large-lengths`` (seconds per step, tokens/s, peak memory
   per GPU), and calibrate-delta over ``--large-traces`` × ``--large-trace-tokens`` token traces, once under
   ZeRO-3 (one process per GPU, traces split) and once in one process with ``--device-map auto``.

Everything lands in ``--out``: each command's log, ``multi_gpu.json`` and a printed table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from benchmarks.report import at_least
from rolecall.cli import Parser

ROOT = Path(__file__).resolve().parents[1]

# DeepSeek-R1-Distill-Qwen-14B's architecture (Qwen2.5-14B)
QWEN_14B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=5120,
                intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                use_sliding_window=False, torch_dtype="bfloat16")

# DeepSeek-R1-Distill-Llama-70B's architecture (Llama-3.3-70B)
LLAMA_70B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=8192,
                 intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                 max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192},
                 bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")

LIMIT_S = 300  # per command; --limit
MIN_CONTEXT = 256  # calibrate-delta's --min-context: it records query positions from this one on


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def launch(name: str, module: str, args: list[str], out: Path, processes: int = 1,
           accelerate_config: str | None = None, gpus: str | None = None) -> dict[str, Any]:
    """Run ``python -m module args`` (one process) or under ``accelerate launch``; log to out/<name>.log."""
    if processes == 1 and accelerate_config is None:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / f"{accelerate_config}.yaml"), "--num_processes", str(processes),
               "--main_process_port", str(29500 + hash(name) % 1000), "-m", module, *args]
    env = _env()
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    began = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:  # a hung collective must not take the whole run with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "timeout"
            log.write(f"\nkilled after {LIMIT_S} s\n")
    seconds = time.perf_counter() - began
    print(f"  {name}: exit {code} in {seconds:.1f} s", flush=True)
    if code != 0:
        tail = (out / f"{name}.log").read_text().splitlines()[-25:]
        print("\n".join("    " + line for line in tail), flush=True)
    # recorded without this machine's paths, so results compare across machines
    shown = shlex.join(cmd).replace(sys.executable, "python").replace(str(out), "<out>").replace(str(ROOT) + "/", "")
    return {"name": name, "exit": code, "seconds": round(seconds, 2), "command": shown}


def _log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _median_step(records: list[dict[str, Any]], warmup: int) -> float | None:
    times = [r["seconds"] for r in records[warmup:] if "seconds" in r]
    return statistics.median(times) if times else None


def _compare_logs(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Largest relative differences of the per-step numbers of two runs over the steps both logged."""
    def rel(x: float, y: float) -> float:
        return abs(x - y) / max(abs(x), abs(y), 1e-12)

    by_step = {y["step"]: y for y in b}
    common = [(x, by_step[x["step"]]) for x in a if x["step"] in by_step]
    if not common:
        return {"steps": 0}
    return {
        "steps": len(common),
        "same_samples": all(x["sample"] == y["sample"] for x, y in common),
        "loss_max_rel_diff": max(rel(x["distill_loss"], y["distill_loss"]) for x, y in common),
        "expected_l0_max_rel_diff": max(rel(x["expected_l0"], y["expected_l0"]) for x, y in common),
        "lambda_max_rel_diff": max(rel(x["lambda"], y["lambda"]) for x, y in common),
        "gate_max_abs_diff": max(max(abs(p - q) for p, q in zip(x["expected_gate"], y["expected_gate"]))
                                 for x, y in common),
    }


def _compare_manifests(a: Path, b: Path) -> dict[str, Any]:
    import torch

    from rolecall.core.manifest import RoleManifest

    if not (a.is_file() and b.is_file()):
        return {"compared": False}
    ma, mb = RoleManifest.load(a), RoleManifest.load(b)
    ta, tb = ma.tensors(), mb.tensors()
    diffs = {k: float((ta[k].double() - tb[k].double()).abs().max()) if ta[k].numel() else 0.0
             for k in ta if k in tb and ta[k].shape == tb[k].shape}
    return {"compared": True, "bytes_identical": a.read_bytes() == b.read_bytes(),
            "same_tensors": set(ta) == set(tb), "tensors_equal": all(torch.equal(ta[k], tb[k]) for k in ta if k in tb),
            "max_abs_diff": max(diffs.values(), default=0.0), "differing": sorted(k for k, v in diffs.items() if v)}


def traces_file(path: Path, tokenizer_model: str, count: int, tokens: int) -> Path:
    """``count`` traces of ``tokens`` tokens cut from the offline essay corpus."""
    from rolecall.core.models import load_tokenizer
    from rolecall.data.corpora import PGEssays

    tok = load_tokenizer(tokenizer_model)
    ids: list[int] = []
    for doc in PGEssays():
        ids += tok(doc.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= count * tokens:
            break
    lines = [json.dumps({"ids": ids[i * tokens:(i + 1) * tokens]}) for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def random_dataset(path: Path, samples: int, prompt: int, vocab: int, seed: int = 0) -> Path:
    """Prompts of ``prompt`` random tokens and a 64-token span with 16 labelled tokens (passkey-like shape)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(samples):
            ids = torch.randint(0, vocab, (prompt + 64,), generator=g)
            labels = torch.full_like(ids, -100)
            labels[prompt + 48:] = ids[prompt + 48:]
            f.write(json.dumps({"input_ids": ids.tolist(), "labels": labels.tolist()}) + "\n")
    return path


def part_calibrate(args, out: Path) -> dict[str, Any]:
    traces = traces_file(out / "traces.jsonl", args.model, args.traces, args.trace_tokens)
    common = ["--model", args.model, "--traces", str(traces), "--no-plots", "--quiet", "--min-context", str(MIN_CONTEXT)]
    one = launch("calibrate-1", "rolecall.calibrate", [*common, "--output", str(out / "cal1.safetensors")], out)
    two = launch("calibrate-2", "rolecall.calibrate", [*common, "--output", str(out / "cal2.safetensors")], out, 2, "multi_gpu")
    return {"runs": [one, two], **_compare_manifests(out / "cal1.safetensors", out / "cal2.safetensors")}


def part_ddp(args, out: Path) -> dict[str, Any]:
    half = max(args.steps // 2, 1)
    common = ["--model", args.model, "--batch-size", "2", "--steps", str(args.steps), "--target", "8",
              "--lengths", "1000,4000", "--no-plots", "--checkpoint-every", str(half)]
    if args.model_name:
        common += ["--model-name", args.model_name]
    runs = [launch("ddp-1", "rolecall.train", [*common, "--output", str(out / "ddp1" / "heads.safetensors"), "--overwrite"], out, gpus="0"),
            launch("ddp-2", "rolecall.train", [*common, "--output", str(out / "ddp2" / "heads.safetensors"), "--overwrite"], out, 2, "multi_gpu")]
    # the 2-GPU run's half-way checkpoint, finished on 1 GPU
    ckpt = out / "ddp2" / "heads.ckpt" / f"step-{half:07d}.pt"
    (out / "ddp-resume-1").mkdir(exist_ok=True)
    runs.append(launch("ddp-resume-1", "rolecall.train", [*common, "--output", str(out / "ddp-resume-1" / "heads.safetensors"),
                                                  "--resume", str(ckpt)], out, gpus="0"))
    a, b = _log(out / "ddp1" / "heads.log.jsonl"), _log(out / "ddp2" / "heads.log.jsonl")
    r = _log(out / "ddp-resume-1" / "heads.log.jsonl")
    s1, s2 = _median_step(a, args.warmup), _median_step(b, args.warmup)
    return {"runs": runs, "agreement_1_vs_2": _compare_logs(a, b),
            "manifests_1_vs_2": _compare_manifests(out / "ddp1" / "heads.safetensors", out / "ddp2" / "heads.safetensors"),
            "resumed_on_1_vs_uninterrupted_2": _compare_logs(b, r),
            "resumed_manifest_vs_uninterrupted_2": _compare_manifests(out / "ddp2" / "heads.safetensors",
                                                                       out / "ddp-resume-1" / "heads.safetensors"),
            "step_seconds_1gpu": s1, "step_seconds_2gpu": s2,
            "steps_per_second_1gpu": 1 / s1 if s1 else None, "steps_per_second_2gpu": 1 / s2 if s2 else None,
            "scaling": s1 / s2 if s1 and s2 else None}


def part_zero3(args, out: Path) -> dict[str, Any]:
    folder = out / "qwen14b"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN_14B, indent=1))
    data = random_dataset(out / "zero3.jsonl", 8, args.zero3_prompt, QWEN_14B["vocab_size"])

    def common(dataset: Path) -> list[str]:
        return ["--model", str(folder / "config.json"), "--model-name", "ds-qwen-14b-random", "--random-weights",
                "--dataset", str(dataset), "--dtype", "bfloat16", "--mixed-precision", "bf16", "--target", "32",
                "--batch-size", "2", "--prefill-chunk", "4096", "--no-plots", "--checkpoint-every", "2"]

    steps = ["--steps", str(args.zero3_steps)]
    runs = [launch("zero3-2", "rolecall.train", [*common(data), *steps, "--output", str(out / "z2" / "heads.safetensors"), "--overwrite"],
                   out, 2, "zero3")]
    ckpt = out / "z2" / "heads.ckpt" / "step-0000002.pt"
    (out / "z2-resume").mkdir(exist_ok=True)
    runs.append(launch("zero3-resume-2", "rolecall.train", [*common(data), *steps, "--output", str(out / "z2-resume" / "heads.safetensors"),
                                                   "--resume", str(ckpt)], out, 2, "zero3"))
    runs.append(launch("plain-1", "rolecall.train", [*common(data), *steps, "--output", str(out / "plain1" / "heads.safetensors"), "--overwrite"],
                       out, gpus="0"))
    full, resumed, plain = (_log(out / d / "heads.log.jsonl") for d in ("z2", "z2-resume", "plain1"))
    result: dict[str, Any] = {
        "steps_completed_2gpu_zero3": len(full), "checkpoint_written": ckpt.is_file(),
        "resumed_vs_uninterrupted": _compare_logs(full, resumed),
        "resumed_manifest_vs_uninterrupted": _compare_manifests(out / "z2" / "heads.safetensors",
                                                                out / "z2-resume" / "heads.safetensors"),
        "step_seconds_2gpu_zero3": _median_step(full, 1), "step_seconds_1gpu_plain": _median_step(plain, 1),
        "peak_gib_per_gpu_2gpu_zero3": max((r.get("peak_gib", 0) for r in full), default=None),
        "peak_gib_1gpu_plain": max((r.get("peak_gib", 0) for r in plain), default=None),
        "note": "random weights: zero.Init draws them on the GPU shards and plain init elsewhere, so 1-GPU and "
                "ZeRO-3 runs are compared on time and memory, not on numbers",
    }
    memory = []
    for length in args.prompt_lengths:
        data_n = random_dataset(out / f"len{length}.jsonl", 2, length, QWEN_14B["vocab_size"], seed=length)
        dest = out / f"len{length}" / "heads.safetensors"
        run = launch(f"zero3-len{length}", "rolecall.train", [*common(data_n), "--steps", "2", "--output", str(dest), "--overwrite"], out, 2, "zero3")
        log = _log(dest.with_name("heads.log.jsonl"))
        memory.append({"prompt_tokens": length, "ok": run["exit"] == 0 and len(log) == 2,
                       "step_seconds": _median_step(log, 1),
                       "peak_gib_per_gpu": max((r.get("peak_gib", 0) for r in log), default=None)})
        runs.append(run)
    return {"runs": runs, **result, "prompt_memory_2gpu_zero3": memory}


def _calibrate_cost(log: Path) -> dict[str, float | None]:
    """Seconds per trace and peak GiB per GPU from calibrate-delta's closing line."""
    import re

    text = log.read_text() if log.is_file() else ""
    per_trace = re.search(r"([0-9.]+) s per trace per process", text)
    peak = re.search(r"peak GPU memory ([0-9.]+) GiB", text)
    return {"seconds_per_trace_per_process": float(per_trace.group(1)) if per_trace else None,
            "peak_gib_per_gpu": float(peak.group(1)) if peak else None}


def part_large(args, out: Path) -> dict[str, Any]:
    """The 70B architecture with random bf16 weights built already sharded: train-heads under ZeRO-3 at each of
    ``--large-lengths`` and calibrate-delta over ``--large-traces`` traces, ZeRO-3 and ``--device-map auto``."""
    import torch

    gpus = torch.cuda.device_count()
    folder = out / "llama70b"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_70B, indent=1))
    model = ["--model", str(folder / "config.json"), "--random-weights", "--dtype", "bfloat16"]
    result: dict[str, Any] = {"architecture": "DeepSeek-R1-Distill-Llama-70B (random bf16 weights)", "gpus": gpus,
                              "weights_gib": None, "train": [], "calibrate": []}
    runs = []
    counts = sorted({min(n, gpus) for n in args.large_gpus}) if args.large_gpus else [gpus]
    for n in counts:  # one sample per process and step: the global batch is the GPU count
        for length in args.large_lengths:
            name = f"large{length}" + (f"-{n}gpu" if n != gpus else "")
            data = random_dataset(out / f"{name}.jsonl", n * args.large_steps, length, LLAMA_70B["vocab_size"])
            dest = out / name / "heads.safetensors"
            run = launch(f"large-train-{length}" + (f"-{n}gpu" if n != gpus else ""), "rolecall.train",
                         [*model, "--model-name", "ds-llama-70b-random", "--dataset", str(data), "--mixed-precision",
                          "bf16", "--target", "32", "--batch-size", str(n), "--prefill-chunk", "4096", "--no-plots",
                          "--checkpoint-every", "1000", "--steps", str(args.large_steps), "--output", str(dest),
                          "--overwrite"], out, n, "zero3", gpus=",".join(map(str, range(n))) if n != gpus else None)
            runs.append(run)
            log = _log(dest.with_name("heads.log.jsonl"))
            step = _median_step(log, 1)
            result["train"].append({
                "gpus": n, "prompt_tokens": length, "ok": run["exit"] == 0 and len(log) == args.large_steps,
                "steps": len(log), "step_seconds": step,
                "tokens_per_second": round(n * (length + 64) / step, 1) if step else None,
                "peak_gib_per_gpu": max((r.get("peak_gib", 0) for r in log), default=None),
                "launch_seconds": run["seconds"]})
    traces = out / "large_traces.jsonl"
    g = torch.Generator().manual_seed(0)
    traces.write_text("".join(json.dumps({"ids": torch.randint(0, LLAMA_70B["vocab_size"], (args.large_trace_tokens,),
                                                                generator=g).tolist()}) + "\n"
                              for _ in range(args.large_traces)))
    calibrate = [*model, "--traces", str(traces), "--no-plots", "--quiet", "--min-context", str(MIN_CONTEXT)]
    for name, processes, extra in (("zero3", gpus, []), ("device-map", 1, ["--device-map", "auto"])):
        run = launch(f"large-calibrate-{name}", "rolecall.calibrate",
                     [*calibrate, *extra, "--output", str(out / f"large-{name}.safetensors")], out,
                     processes, "zero3" if name == "zero3" else None)
        runs.append(run)
        result["calibrate"].append({"placement": name, "processes": processes, "traces": args.large_traces,
                                    "trace_tokens": args.large_trace_tokens, "ok": run["exit"] == 0,
                                    "launch_seconds": run["seconds"], **_calibrate_cost(out / f"large-calibrate-{name}.log")})
    c = LLAMA_70B
    kv = c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    layer = c["hidden_size"] * (2 * c["hidden_size"] + 2 * kv) + 3 * c["hidden_size"] * c["intermediate_size"]
    result["weights_gib"] = round((2 * c["vocab_size"] * c["hidden_size"] + c["num_hidden_layers"] * layer) * 2 / 2**30, 1)
    return {"runs": runs, **result}


PARTS = {"calibrate": part_calibrate, "ddp": part_ddp, "zero3": part_zero3, "large": part_large}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked; ``parts`` as a list of names."""
    p = Parser(prog=Path(__file__).name, description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a real model for calibration and DDP training")
    p.add_argument("--model-name", help="name recorded in the manifests")
    p.add_argument("--out", default="benchmarks/results/multi_gpu")
    p.add_argument("--parts", default="calibrate,ddp,zero3", help=f"comma-separated: {', '.join(PARTS)}")
    p.add_argument("--traces", type=int, default=8)
    p.add_argument("--trace-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30, help="DDP comparison steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--zero3-steps", type=int, default=4)
    p.add_argument("--zero3-prompt", type=int, default=4096)
    p.add_argument("--prompt-lengths", type=int, nargs="*", default=[16384, 32768])
    p.add_argument("--large-lengths", type=int, nargs="*", default=[4096, 10240], help="large: prompt tokens")
    p.add_argument("--large-gpus", type=int, nargs="*", default=[],
                   help="large: train-heads on each of these GPU counts (default: every visible GPU)")
    p.add_argument("--large-steps", type=int, default=4, help="large: train-heads steps per prompt length")
    p.add_argument("--large-traces", type=int, default=8, help="large: calibration traces")
    p.add_argument("--large-trace-tokens", type=int, default=8192, help="large: tokens per calibration trace")
    p.add_argument("--limit", type=int, default=LIMIT_S, help="seconds before a command is killed")
    args = p.parse_args(argv)
    p.check_writable(args.out, "--out", folder=True)
    args.parts = p.names(args.parts, "--parts", PARTS)
    tokens = (MIN_CONTEXT + 1, f"calibrate-delta records from position {MIN_CONTEXT} on")
    at_least(p, args, traces=1, trace_tokens=tokens, steps=(2, "a 1-GPU run resumes the half-way checkpoint"),
             warmup=0, zero3_steps=(3, "the resumed runs continue from the step-2 checkpoint"), zero3_prompt=1,
             prompt_lengths=1, large_lengths=1, large_gpus=1, large_steps=1, large_traces=1, large_trace_tokens=tokens, limit=1)
    if args.warmup >= args.steps:
        p.error(f"--warmup must be below --steps ({args.steps}): the steps after it are timed, got {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = args.parts
    globals()["LIMIT_S"] = args.limit
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                              "gpus": torch.cuda.device_count(), "torch": torch.__version__}
    for part in parts:
        print(f"[{part}]", flush=True)
        result[part] = PARTS[part](args, out)
        (out / "multi_gpu.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
