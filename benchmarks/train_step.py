"""Seconds per train-heads step and peak GPU memory, Llama-3-8B architecture with random bf16 weights.

For each prompt length it times, in the same run:

- ``baseline``: what any distillation step must do anyway: the teacher's chunked prefill of the prompt and
  its forward over the target span (no gradients);
- ``train step``: one full step of the recipe: the baseline plus the student's hybrid forward, the backward
  pass into the gates and the optimizer and λ updates (``rolecall.train.recipe`` does the same per step), with
  the fused hybrid-attention kernels the recipe runs on a GPU (``rolecall.train.hybrid_kernel``);
- ``reference step``: the same step with the PyTorch reference ``hybrid_layer`` (float32 scores, recomputed
  under checkpointing unless ``--no-checkpointing``), the attention before the kernels.

Medians over ``--repeats`` steps after ``--warmup`` untimed ones; CUDA events; the GPU is named in the
table and the JSON. Random weights give near-uniform attention, which does not change the work done.

    python -m benchmarks.train_step --lengths 1000 4000 10000 --json train_step.json

Beside each length it projects the published recipe's wall time (``configs/train/llama3-8b-1048k.yaml``: its
``steps`` and ``checkpoint_every``): steps × the measured step, plus one checkpoint write (the gates' and the
optimizer's state, timed here) per interval. The recipe runs no evaluation between steps; loading the model and
building the dataset come before and are not in it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from benchmarks.report import at_least
from benchmarks.timing import event_times
from rolecall.cli import Parser
from rolecall.core.models import cache_keyword
from rolecall.train.distill import distill_loss, prefill, split_sample
from rolecall.train.gates import GateParameters
from rolecall.train.hybrid import HybridAttention, fast_float32_matmul

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def build_model(layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    return model


def sample(prompt_tokens: int, span: int, answers: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt followed by a target span in which ``answers`` tokens carry labels (like passkey answers)."""
    g = torch.Generator().manual_seed(prompt_tokens)
    ids = torch.randint(0, vocab, (prompt_tokens + span,), generator=g)
    labels = torch.full_like(ids, -100)
    where = torch.linspace(prompt_tokens + 1, prompt_tokens + span - 1, answers).long()
    labels[where] = ids[where]
    return ids, labels


def time_cuda(fn, warmup: int, repeats: int) -> tuple[float, list[float]]:
    """Median and all seconds of ``repeats`` calls after ``warmup`` (CUDA events)."""
    times = [ms / 1000 for ms in event_times(fn, repeats, warmup)]
    return statistics.median(times), times


RECIPE = Path(__file__).resolve().parents[1] / "configs" / "train" / "llama3-8b-1048k.yaml"


def recipe_settings(path: Path = RECIPE) -> tuple[int, int]:
    """The published recipe's ``steps`` and ``checkpoint_every``."""
    from rolecall.train.config import read_yaml

    doc = read_yaml(str(path))
    return int(doc["steps"]), int(doc["checkpoint_every"])


def projected_recipe_s(step_s: float, steps: int, checkpoint_every: int, checkpoint_s: float) -> float:
    """Seconds of ``steps`` steps of ``step_s`` and a checkpoint of ``checkpoint_s`` every ``checkpoint_every``
    steps (the last step's included)."""
    return steps * step_s + (steps // checkpoint_every) * checkpoint_s


def checkpoint_seconds(gates: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Median seconds of writing the gates' and the optimizer's state to a file (what a checkpoint holds)."""
    import tempfile
    import time

    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(5):
            t0 = time.perf_counter()
            torch.save({"gates": gates.state_dict(), "optimizer": optimizer.state_dict()}, f"{tmp}/step-{i}.pt")
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=Path(__file__).name, description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000, 10000])
    p.add_argument("--span", type=int, default=730, help="target-span tokens (10 passkeys of 32 words: about 730 with SmolLM2's tokenizer)")
    p.add_argument("--answers", type=int, default=600, help="labelled tokens inside the span")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--budget", type=float, default=0.3)
    p.add_argument("--prefill-chunk", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--no-tf32", action="store_true", help="exact float32 attention scores")
    p.add_argument("--json", default="train_step.json")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="also profile one step at the longest prompt and write the kernels by GPU time to FILE")
    args = p.parse_args(argv)
    for flag in ("json", "profile"):  # written after the timing: refused now if they cannot be
        p.check_writable(getattr(args, flag), f"--{flag}")
    at_least(p, args, lengths=1, span=(2, "the labelled tokens follow its first"), answers=1,
             layers=(2, "layer 0 stays full, the others get gates"), prefill_chunk=1, warmup=0, repeats=1)
    if args.answers >= args.span:
        p.error(f"--answers must be below --span ({args.span}): each labels one of the span's tokens after its "
                f"first, got {args.answers}")
    if not 0 < args.budget <= 1:
        p.error(f"--budget must be the fraction of the context a sparse head reads, in (0, 1], got {args.budget}")
    return args


def report(args, gpu: str, rows: list[dict], ckpt_s: float) -> None:
    """The table (with each length's projected recipe time, checkpoints of ``ckpt_s`` seconds included) and the
    JSON file ``--json``."""
    print(f"\nGPU: {gpu}; Llama-3-8B architecture ({args.layers} layers), bf16 random weights, torch {torch.__version__}")
    print(f"span {args.span} tokens, {args.answers} targets, budget {args.budget}, prefill chunk {args.prefill_chunk}, "
          f"reference's attention checkpointing {'off' if args.no_checkpointing else 'on'}, TF32 {'off' if args.no_tf32 else 'on'}, median of {args.repeats} after {args.warmup} warm-up")
    steps, every = recipe_settings()
    for r in rows:
        r["recipe_projected_s"] = projected_recipe_s(r["train_step_s"], steps, every, ckpt_s)
    print(f"{'prompt':>8} {'baseline s':>11} {'reference s':>12} {'step s':>8} {'baseline GiB':>13} "
          f"{'reference GiB':>14} {'step GiB':>9} {'recipe min':>11}")
    for r in rows:
        print(f"{r['prompt_tokens']:>8} {r['baseline_s']:>11.3f} {r['reference_step_s']:>12.3f} "
              f"{r['train_step_s']:>8.3f} {r['baseline_peak_gib']:>13.1f} {r['reference_step_peak_gib']:>14.1f} "
              f"{r['train_step_peak_gib']:>9.1f} {r['recipe_projected_s'] / 60:>11.1f}")
    print(f"recipe: {steps} steps, a checkpoint every {every} ({ckpt_s * 1e3:.1f} ms each), no evaluation between "
          f"steps ({RECIPE.name})")
    result = {"gpu": gpu, "torch": torch.__version__, "rows": rows,
              # the output files by name only: a report holds no machine's paths
              "args": {k: (Path(v).name if k in ("json", "profile") and v else v) for k, v in vars(args).items()},
              "recipe": {"file": RECIPE.name, "steps": steps, "checkpoint_every": every, "checkpoint_s": ckpt_s}}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    model = build_model(args.layers)
    num_kv = model.config.num_key_value_heads
    gates = GateParameters("hardkuma", (args.layers - 1, num_kv)).cuda()
    optimizer = torch.optim.Adam(gates.parameters(), lr=0.01)
    hybrids = {"reference_step": HybridAttention(args.layers, args.budget, checkpoint=not args.no_checkpointing,
                                                 fused=False),
               "train_step": HybridAttention(args.layers, args.budget)}
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in args.lengths:
        ids, labels = sample(n, args.span, args.answers, model.config.vocab_size)
        ids, labels = ids.cuda(), labels.cuda()

        def baseline(ids=ids, labels=labels):
            s = split_sample(ids, labels)
            with torch.no_grad():
                cache = prefill(model, s.prompt, args.prefill_chunk)
                model(input_ids=s.span, **{cache_keyword(model): cache}, use_cache=True).logits.float()

        lam = 0.0

        def step(ids=ids, labels=labels, hybrid=hybrids["train_step"]):
            nonlocal lam
            dist = gates.distribution()
            z = dist.rsample(generator=generator)
            loss_d, _ = distill_loss(model, hybrid, z, ids, labels, args.prefill_chunk)
            l0 = dist.expected_l0()
            loss = loss_d + lam * (l0 - 32)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            lam = max(0.0, lam + 0.01 * (float(l0.detach()) - 32))

        def reference_step(ids=ids, labels=labels):
            step(ids, labels, hybrids["reference_step"])

        row = time_row(args, n, {"baseline": baseline, "reference_step": reference_step, "train_step": step})
        rows.append(row)
        print(f"{n}: baseline {row['baseline_s']:.3f} s, reference step {row['reference_step_s']:.3f} s, "
              f"step {row['train_step_s']:.3f} s", flush=True)
    if args.profile:
        write_profile(args, step, gpu)
    report(args, gpu, rows, checkpoint_seconds(gates, optimizer))
    return 0


def time_row(args: argparse.Namespace, n: int, calls: dict) -> dict:
    """One row of the table: each call's (name → function) median and all seconds and its peak GiB."""
    row = {"prompt_tokens": n, "span_tokens": args.span}
    for name, fn in calls.items():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with fast_float32_matmul(not args.no_tf32):
            median, times = time_cuda(fn, args.warmup, args.repeats)
        row[f"{name}_s"] = median
        row[f"{name}_times_s"] = times
        row[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def write_profile(args: argparse.Namespace, step, gpu: str) -> None:
    """The kernels of one ``step`` at the longest prompt by GPU time, into ``--profile``."""
    with fast_float32_matmul(not args.no_tf32), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60)
    Path(args.profile).write_text(f"one train step, {args.lengths[-1]} prompt tokens, {gpu}\n{table}\n")


if __name__ == "__main__":
    sys.exit(main())
