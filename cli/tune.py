"""``rolecall tune``: choose the cheapest decode setting that keeps a model within a stated drop of full attention
on the user's prompts, and write it into the manifest as its recommended setting.

The choice and its evidence are :mod:`rolecall.eval.tune`'s. The new manifest is the given one (with ``--heads``,
merged with that heads manifest) plus ``recommended``: a new content hash, and the same bytes for the same
evidence. ``rolecall decode``, ``rolecall serve`` and ``attach(model, manifest)`` use it when no policy is named.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from rolecall.cli.common import (
    add_device,
    add_manifest,
    add_model,
    add_prompt_arguments,
    check_device_map,
    check_policy,
    check_prompt_arguments,
    chosen_device,
    eval_settings,
    load_placed,
)

DEFAULT_OUT = "out/tune"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser)
    add_manifest(parser, "the manifest the recommendation is written for (a layers manifest from calibrate-delta, "
                 "a heads one from train-heads, or both merged)", required=True)
    parser.add_argument("--heads", default=None, help="a heads manifest (train-heads) to merge in, so lychee is "
                        "tried too; the written manifest then holds both sections")
    add_prompt_arguments(parser, passkey_words=2, alphabet="nato", limit=8)
    parser.add_argument("--batch", type=int, default=1, help="the batch you decode at: the candidates are timed "
                        "there (default 1)")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens the candidates are timed at "
                        "(default: the longest prompt)")
    parser.add_argument("--max-drop", type=float, default=1.0, help="the largest loss against full attention you "
                        "accept, in points (hundredths of the score): a setting qualifies when its paired 95 %% "
                        "interval's lower end lies above -max-drop (default 1.0)")
    parser.add_argument("--policies", default=None, help="comma-separated, of delta, lychee, quest, lethe "
                        "(default: delta, lychee and quest where the manifest allows them)")
    parser.add_argument("--budgets", default="512,1024,2048", help="token budgets to try (default 512,1024,2048)")
    parser.add_argument("--refine", default="1,4", help="delta's refine values to try (default 1,4; 1 = off)")
    parser.add_argument("--cost", default="tpot", choices=("tpot", "keys"), help="what cheapest means: TPOT on the "
                        "engine at --batch and --context (default), or the share of the context read (the same "
                        "on any machine)")
    parser.add_argument("--time-tokens", type=int, default=16, help="tokens generated per timed request (default 16)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"the run folder: checkpoints, tune.json, frontier.png "
                        f"(default {DEFAULT_OUT}); a rerun with it resumes")
    parser.add_argument("--output", "-o", default=None, help="the manifest to write (default: OUT/manifest.safetensors)")
    add_device(parser)
    # every candidate decodes on the engine (also on the CPU), in batches; one model on one device
    parser.set_defaults(param=["engine=static"], measure=False, device_map=None)


def check_arguments(args: argparse.Namespace):
    """Every flag, before anything loads: the tune settings, the prompt flags, the device, the outputs."""
    from rolecall.cli import Parser
    from rolecall.core.atomic import check_writable
    from rolecall.eval.tune import TuneSettings

    if args.suite == "reasoning":
        raise ValueError("--suite reasoning has no answers to score; use passkey, ruler, longbench or --prompts")
    try:
        tuning = TuneSettings(max_drop=args.max_drop, batch=args.batch, context=args.context,
                              time_tokens=args.time_tokens, cost=args.cost, eval_batch=args.batch_size)
    except ValueError as e:
        raise ValueError(f"--{str(e).replace('_', '-')}") from None
    check_prompt_arguments(args)
    chosen_device(args)
    check_device_map(args, "rolecall tune")
    check_writable(args.out, "--out", folder=True)
    if args.output:  # else it goes into --out, checked above
        check_writable(args.output, "--output")
    args.output = args.output or str(Path(args.out) / "manifest.safetensors")
    parser = Parser(prog="rolecall tune")
    args.budgets = parser.counts(args.budgets, "--budgets", "token budgets")
    args.refine = parser.counts(args.refine, "--refine", "refine values")
    return tuning


def load_manifest(args: argparse.Namespace, config):
    """``--manifest``, merged with ``--heads`` when given, checked against the model's config."""
    from rolecall.core.manifest import RoleManifest
    from rolecall.core.manifest.interop import merge_manifests

    manifest = RoleManifest.load(args.manifest)
    if args.heads:
        manifest = merge_manifests(manifest, RoleManifest.load(args.heads))
    manifest.validate_for(config)
    return manifest


def run_record(args: argparse.Namespace, settings) -> dict:
    """What the run was, for the manifest's evidence: the prompts and the command, without paths of this machine."""
    from rolecall.core.manifest import portable_name

    source = [f"--prompts {portable_name(args.prompts)}"] if args.prompts else [
        f"--suite {args.suite}", f"--lengths {' '.join(map(str, args.lengths))}", f"--seed {args.seed}"]
    command = ["rolecall tune", f"--model {portable_name(args.model)}", *source, f"--batch {args.batch}",
               f"--max-drop {args.max_drop:g}", f"--cost {args.cost}"]
    return {"suite": None if args.prompts else args.suite, "prompts_file": portable_name(args.prompts),
            "lengths": None if args.prompts else list(settings.lengths), "seed": settings.seed, "command": " ".join(command)}


def run(args: argparse.Namespace) -> int:
    from rolecall.core.atomic import write_text
    from rolecall.core.models import load_config, load_tokenizer
    from rolecall.eval import check_samples, suite_prompts
    from rolecall.eval.tune import (
        candidates,
        check_answers,
        format_table,
        plot_frontier,
        recommendation,
        tune,
    )

    tuning = check_arguments(args)
    config = load_config(args.model, trust_remote_code=args.trust_remote_code)
    manifest = load_manifest(args, config)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip()) if args.policies else None
    found = candidates(manifest.sections, policies, tuple(args.budgets), tuple(args.refine))
    for c in found:
        check_policy(c.policy, c.params, manifest, config)
    settings = eval_settings(args)
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    samples = suite_prompts(tokenizer, settings)
    check_samples(samples, config, settings, args.allow_long_context, name=args.prompts or f"the {args.suite} prompts",
                  new_name="--max-new-tokens", opt_in="--allow-long-context", fix="shorten the prompts or lower "
                  "--max-new-tokens")
    check_answers(samples)
    model = load_placed(args)
    header = {"model": args.model, "manifest_sha256": hashlib.sha256(manifest.to_bytes()).hexdigest(),
              "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k not in ("prompts", "data")}}
    result = tune(model, tokenizer, manifest, found, samples, settings, tuning, args.out, header,
                  progress=lambda line: print(f"rolecall tune: {line}", file=sys.stderr))
    print(format_table(result))
    tuned = dataclasses.replace(manifest, recommended=recommendation(result, run_record(args, settings)))
    tuned.save(args.output)
    plot = plot_frontier(result, Path(args.out) / "frontier.png")
    write_text(Path(args.out) / "result.json", json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.output} (recommended: {result['chosen']['name']}), {plot} and {Path(args.out) / 'result.json'}",
          file=sys.stderr)
    return 0
