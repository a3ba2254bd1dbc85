"""``rolecall eval``: compare a decode policy with dense attention on passkey (or JSONL) prompts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from runtime.cli.common import add_common, policy_inputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000], help="passkey context lengths")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="passkey depths in [0, 1]")
    parser.add_argument("--samples-per-cell", type=int, default=1)
    parser.add_argument("--passkey-words", type=int, default=2)
    parser.add_argument("--alphabet", default="nato", choices=("nato", "digits"),
                        help="passkey words: NATO code words, or digits (small models copy digits, not words)")
    parser.add_argument("--source", default="pg-essays", help="haystack text (see data.corpora)")
    parser.add_argument("--suite", default="passkey", choices=("passkey", "ruler", "reasoning"),
                        help="passkey: the single-passkey grid (--lengths x --depths); ruler: the RULER-style suite "
                             "of data.ruler (--tasks x --lengths, --samples-per-cell each), generated offline; "
                             "reasoning: full attention's own greedy traces on reasoning prompts, the policy fed the "
                             "same tokens (per-step KL, top-1 agreement, divergence point)")
    parser.add_argument("--reasoning-source", default="champ",
                        help="reasoning prompts: champ, arithmetic[:N] or jsonl:PATH (see data.reasoning)")
    parser.add_argument("--limit", type=int, default=8, help="reasoning prompts to use (default 8)")
    parser.add_argument("--tasks", nargs="+", default=None, help="RULER tasks (default: all; see data.ruler)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the RULER prompts")
    parser.add_argument("--prompts", default=None, help='JSONL file of {"prompt": ..., "answer": ...} (or '
                                                        '"answers": [...]) instead of generated prompts')
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens generated per prompt (default 12; 1024 for --suite reasoning; RULER tasks carry "
                             "their own: 128 for needles, 30, 120, 50)")
    parser.add_argument("--json", default=None, help="write the full result here")
    parser.add_argument("--measure", action="store_true", help="also measure per-layer attention recall and keys "
                        "read (runs the slower transformers path)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="prompts of one length decoded together on the engine [16 on a GPU, 1 elsewhere]")
    parser.add_argument("--rope-theta", type=float, default=None,
                        help="another RoPE base for the model (run it past its trained context, with "
                        "--allow-long-context), e.g. 400000 for SmolLM2 at 16K-32K")
    parser.add_argument("--allow-long-context", action="store_true",
                        help="run prompts longer than the model's context (max_position_embeddings) with only a "
                        "warning: for a model whose RoPE you extended on purpose")


def load_for_eval(args: argparse.Namespace):
    """The model on ``--device`` (default cuda when there is one) in ``--dtype`` (bf16 on cuda, else fp32)."""
    import torch

    from runtime.models import load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    return load_model(args.model, dtype=getattr(torch, dtype), trust_remote_code=args.trust_remote_code,
                      rope_theta=getattr(args, "rope_theta", None)).to(device)


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {path}")


def run_reasoning(args: argparse.Namespace) -> int:
    from runtime.eval import fidelity, format_fidelity
    from runtime.policies import engine_policies

    if args.policy not in engine_policies():
        raise ValueError(f"--suite reasoning runs on the engine: --policy {args.policy!r} has no engine step yet; "
                         f"use one of {', '.join(engine_policies())}")
    if args.max_new_tokens < 2 or args.limit < 1:
        raise ValueError(f"--max-new-tokens must be at least 2 and --limit at least 1, got {args.max_new_tokens} "
                         f"and {args.limit}")
    from runtime.models import load_tokenizer

    params, manifest = policy_inputs(args)
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    model = load_for_eval(args)
    result = fidelity(model, tokenizer, manifest, args.policy, params, source=args.reasoning_source, limit=args.limit,
                      max_new_tokens=args.max_new_tokens)
    result["model"], result["manifest"] = args.model, args.manifest
    print(format_fidelity(result))
    write_json(args.json, result)
    return 0


def run(args: argparse.Namespace) -> int:
    from runtime.eval import EvalSettings, evaluate, format_table, suite_prompts
    from runtime.models import check_context, context_limit, load_config, load_tokenizer

    if args.max_new_tokens is None:
        args.max_new_tokens = 1024 if args.suite == "reasoning" else 12
    if args.rope_theta is not None and args.rope_theta <= 0:
        raise ValueError(f"--rope-theta must be a positive number, got {args.rope_theta}")
    if args.suite == "reasoning":
        return run_reasoning(args)
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")

    settings = EvalSettings(lengths=tuple(args.lengths), depths=tuple(args.depths), samples_per_cell=args.samples_per_cell,
                            passkey_words=args.passkey_words, alphabet=args.alphabet, source=args.source, prompts=args.prompts,
                            max_new_tokens=args.max_new_tokens, suite=args.suite, tasks=tuple(args.tasks or ()),
                            seed=args.seed)
    if args.suite == "ruler":
        from data.ruler import TASKS, check_tasks

        budget = max(TASKS[t].max_new_tokens for t in check_tasks(settings.tasks or TASKS))
    else:
        budget = args.max_new_tokens
    params, manifest = policy_inputs(args)
    # prompts longer than the model's context fail here too, before the haystacks are built or the model loads
    trust = args.trust_remote_code
    limit, new = context_limit(load_config(args.model, trust_remote_code=trust), args.model), budget
    fit = dict(limit=limit, allow_long=args.allow_long_context, prog="rolecall eval")
    if not args.prompts:
        plus = f"--max-new-tokens {new}" if args.suite == "passkey" else f"{new} new tokens (its tasks' largest budget)"
        check_context(max(args.lengths) + new, **fit, what=f"--lengths {max(args.lengths)} plus {plus}",
                      fix=f"pass --lengths of at most {limit - new if limit else 0} tokens")
    tokenizer = load_tokenizer(args.model, trust_remote_code=trust)
    samples = suite_prompts(tokenizer, settings)
    if args.prompts:  # a passkey prompt is exactly its length, checked above
        longest = max(len(s["input_ids"]) for s in samples)
        check_context(longest + new, **fit, what=f"the longest prompt of {args.prompts} ({longest} tokens) plus "
                      f"--max-new-tokens {new}", fix="shorten the prompts or lower --max-new-tokens")
    model = load_for_eval(args)
    result = evaluate(model, tokenizer, manifest, args.policy, params, settings, samples=samples,
                      measure=args.measure, batch_size=args.batch_size)
    result["model"] = args.model
    if args.rope_theta is not None:
        result["rope_theta"] = args.rope_theta
    result["manifest"] = args.manifest
    print(format_table(result))
    write_json(args.json, result)
    return 0
