"""Peak GPU memory of one engine request, DS-R1-Distill-Qwen architectures (and Gemma 3 4B's) with random bf16
weights.

For each model shape it measures, in the same run, the memory a request holds beyond the model itself:

- ``copy``: the engine's weights taken as a copy (``Weights.from_model(model)``): q/k/v and gate/up stacked
  beside the model's own projections, more than half of the weights again;
- ``shared``: what ``attach`` does (``rolecall.runtime.engine.shared_weights``): the model's projections become views of
  the stacked matrices, so the request holds its cache and activations only;

and, after ``shared``, whether every byte came back (the model's projections standalone again). A variant that
runs out of memory is reported as such (the 32B shape on an 80 GB GPU with a copy). ``--policies`` measures
``shared`` again for other policies (``lychee``: its cache keeps retrieval heads first, and its decoder still
holds no weights of its own). Random weights change nothing here: memory depends on the shapes alone. The GPU
is named in the table and the JSON.

    python -m benchmarks.memory --models 7b,32b --out results/memory.json
    python -m benchmarks.memory --models gemma3-4b --prompt 32768   # a hybrid model: its sliding layers' rings
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

if not __package__:  # run as a file: its sibling modules are importable only as the package benchmarks
    sys.exit(f"{Path(__file__).name}: run it from the repository root as python -m benchmarks.{Path(__file__).stem}")

from benchmarks.decode import GEMMA3_4B, make_policy, scaled_retrieval_heads
from benchmarks.report import at_least
from rolecall.cli import Parser
from rolecall.runtime.engine import SHAPES, ModelShape

# DeepSeek-R1-Distill-Qwen-32B (Qwen2 architecture): the largest of the family, beside the engine's 7B and 1.5B
MODELS = {**SHAPES, "32b": ModelShape(layers=64, hidden=5120, heads=40, kv_heads=8, head_dim=128, intermediate=27648,
                                     vocab=152064), "gemma3-4b": GEMMA3_4B}
POLICIES = ("full", "lychee")
GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=Path(__file__).name, description=__doc__.split("\n")[0])
    p.add_argument("--models", default="1.5b,7b,32b", help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens of the request")
    p.add_argument("--new", type=int, default=16, help="tokens it generates")
    p.add_argument("--policies", default="full", help=f"comma-separated, from {', '.join(POLICIES)}: the shared "
                   "request under each besides full (lychee with 32 of the 7B's 112 KV heads retrieving, the same "
                   "share elsewhere)")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    args.models = p.names(args.models, "--models", MODELS)
    args.policies = p.names(args.policies, "--policies", POLICIES)
    at_least(p, args, prompt=1, new=1)
    p.check_writable(args.out, "--out")
    return args


def config_of(shape: ModelShape):
    """A transformers config of ``shape``: Gemma 3's text decoder for a hybrid shape, else Qwen2."""
    if shape.sliding_layers:
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                                intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                                num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                                head_dim=shape.head_dim, query_pre_attn_scalar=shape.head_dim,
                                sliding_window=next(w for w in shape.windows if w is not None),
                                layer_types=list(shape.rope_kinds), max_position_embeddings=131072)
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, max_position_embeddings=32768, rope_theta=1e6,
                       tie_word_embeddings=False)


def held_beyond(run) -> float | None:
    """Peak bytes allocated while ``run()`` runs, beyond what was allocated before it; None when it ran out."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        run()
    except torch.OutOfMemoryError:
        return None
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return torch.cuda.max_memory_allocated() - before


def measure(name: str, args: argparse.Namespace) -> dict:
    from rolecall.core.distributed import random_model
    from rolecall.runtime.engine import Weights, generate, shared_weights
    from rolecall.runtime.policies import get_policy

    model = random_model(config_of(MODELS[name]), torch.bfloat16, device="cuda")
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    stacked = sum(p.numel() * p.element_size() for layer in model.model.layers
                  for p in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                            layer.self_attn.v_proj.weight, layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight))
    shape = MODELS[name]
    prompt = torch.randint(0, shape.vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    full = get_policy("full")

    def request(weights, policy=full) -> None:
        generate(weights, policy, [prompt], max_new_tokens=args.new, eos_token_id=[], graphs=False)

    def shared(policy=full) -> None:
        with shared_weights(model, positions=args.prompt + args.new) as weights:
            request(weights, policy)

    row = {"model": name, "weights_gb": weights_bytes / GB, "stacked_gb": stacked / GB}
    before = torch.cuda.memory_allocated()
    row["shared_gb"] = held_beyond(shared)
    row["left_after_gb"] = (torch.cuda.memory_allocated() - before) / GB  # 0: every byte came back
    row["given_back"] = all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    row["copy_gb"] = held_beyond(lambda: request(Weights.from_model(model, positions=args.prompt + args.new)))
    for policy in [p for p in args.policies if p != "full"]:  # full's is shared_gb
        bound = make_policy(policy, shape, 2048, scaled_retrieval_heads(shape, 32))
        row[f"shared_{policy}_gb"] = held_beyond(functools.partial(shared, bound))
    for key in [k for k in row if k.endswith("_gb") and k not in ("weights_gb", "stacked_gb", "left_after_gb")]:
        row[key] = None if row[key] is None else row[key] / GB
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{Path(__file__).name}: error: needs a CUDA device", file=sys.stderr)
        return 2
    gpu, total = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory
    rows = []
    for name in args.models:
        rows.append(measure(name, args))
        torch.cuda.empty_cache()  # the model of the last shape is gone
    print(f"{gpu} ({total / GB:.1f} GB), torch {torch.__version__}, bf16, one request: {args.prompt} prompt tokens, "
          f"{args.new} new; GB held beyond the model's weights at the peak")
    others = [p for p in args.policies if p != "full"]
    print(f"{'model':>9} {'weights':>8} {'q/k/v+gate/up':>14} {'copy':>10} {'shared':>10} {'left after':>11}"
          + "".join(f" {'shared, ' + p:>14}" for p in others))

    def gb(value: float | None) -> str:
        return "out of mem" if value is None else f"{value:.2f}"

    for r in rows:
        left = f"{r['left_after_gb']:.3f}" + ("" if r["given_back"] else " (views!)")
        print(f"{r['model']:>9} {r['weights_gb']:>8.2f} {r['stacked_gb']:>14.2f} {gb(r['copy_gb']):>10} "
              f"{gb(r['shared_gb']):>10} {left:>11}" + "".join(f" {gb(r[f'shared_{p}_gb']):>14}" for p in others))
    if args.out:
        from rolecall.core.atomic import write_text

        write_text(args.out, json.dumps({"gpu": gpu, "gpu_gb": total / GB, "torch": torch.__version__,
                                         "prompt": args.prompt, "new": args.new, "policies": args.policies,
                                         "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
