"""``rolecall eval``: compare a decode policy with dense attention on passkey (or JSONL) prompts."""

from __future__ import annotations

import argparse
import json

from rolecall.cli.common import (
    add_common,
    add_prompt_arguments,
    check_device_map,
    check_prompt_arguments,
    chosen_device,
    eval_settings,
    load_placed,
    policy_inputs,
)
from rolecall.core.atomic import check_writable, write_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    add_prompt_arguments(parser, passkey_words=2, alphabet="nato", limit=8)
    parser.add_argument("--json", default=None, help="write the full result here")
    parser.add_argument("--measure", action="store_true", help="also measure per-layer attention recall and keys "
                        "read (runs the slower transformers path)")

def write_json(path: str | None, result: dict) -> None:
    if path:
        write_text(path, json.dumps(result, indent=2, default=str))
        print(f"wrote {path}")


def run_reasoning(args: argparse.Namespace) -> int:
    from rolecall.core.models import load_config, load_tokenizer
    from rolecall.eval import fidelity, format_fidelity
    from rolecall.runtime.policies import engine_policies

    if args.max_new_tokens < 2 or args.limit < 1:
        raise ValueError(f"--max-new-tokens must be at least 2 and --limit at least 1, got {args.max_new_tokens} "
                         f"and {args.limit}")
    params, manifest = policy_inputs(args, load_config(args.model, trust_remote_code=args.trust_remote_code))
    if args.policy not in engine_policies():
        raise ValueError(f"--suite reasoning runs on the engine: --policy {args.policy!r} has no engine step yet; "
                         f"use one of {', '.join(engine_policies())}")
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    model = load_placed(args)
    result = fidelity(model, tokenizer, manifest, args.policy, params, source=args.reasoning_source, limit=args.limit,
                      max_new_tokens=args.max_new_tokens)
    result["model"], result["manifest"] = args.model, args.manifest
    print(format_fidelity(result))
    write_json(args.json, result)
    return 0


def run(args: argparse.Namespace) -> int:
    from rolecall.core.models import check_context, context_limit, load_config, load_tokenizer
    from rolecall.eval import check_samples, evaluate, format_table, suite_new_tokens, suite_prompts

    check_prompt_arguments(args)
    chosen_device(args)  # a device this machine does not have: refused before anything is built or loaded
    check_device_map(args, "rolecall eval")
    if args.json:
        check_writable(args.json, "--json")  # the results are written at the end: refused now if they cannot be
    if args.suite == "reasoning":
        return run_reasoning(args)
    settings = eval_settings(args)
    budget = suite_new_tokens(settings)  # a prompt file's rows carry no task: --max-new-tokens
    trust = args.trust_remote_code
    config = load_config(args.model, trust_remote_code=trust)
    params, manifest = policy_inputs(args, config)
    # prompts longer than the model's context fail here too, before the haystacks are built or the model loads
    limit, new = context_limit(config, args.model), budget
    fit = dict(limit=limit, allow_long=args.allow_long_context, prog="rolecall eval")
    if not args.prompts:
        plus = f"--max-new-tokens {new}" if args.suite == "passkey" else f"{new} new tokens (its tasks' largest budget)"
        check_context(max(args.lengths) + new, **fit, what=f"--lengths {max(args.lengths)} plus {plus}",
                      fix=f"pass --lengths of at most {limit - new if limit else 0} tokens")
    tokenizer = load_tokenizer(args.model, trust_remote_code=trust)
    samples = suite_prompts(tokenizer, settings)
    # the prompts' ids against the model's vocabulary, and their lengths (a prompt file's; the suites' lengths were
    # checked above, so they warn no second time) against its context, as evaluate() checks them
    check_samples(samples, config, settings, args.allow_long_context, name=args.prompts or f"the {args.suite} prompts",
                  new_name="--max-new-tokens", opt_in="--allow-long-context",
                  warn_as="rolecall eval" if args.prompts else None, fix="shorten the prompts or lower --max-new-tokens")
    model = load_placed(args)
    result = evaluate(model, tokenizer, manifest, args.policy, params, settings, samples=samples,
                      measure=args.measure, batch_size=args.batch_size, allow_long_context=args.allow_long_context)
    result["model"] = args.model
    if args.rope_theta is not None:
        result["rope_theta"] = args.rope_theta
    result["manifest"] = args.manifest
    print(format_table(result))
    write_json(args.json, result)
    return 0
