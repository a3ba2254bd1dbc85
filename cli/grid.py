"""``rolecall grid``: quality of every decode policy at a grid of token budgets, for one model: tables, plots, JSON.

The flags name the policies (with the manifests they need), the budgets and the prompts; every flag that the flags
alone decide is refused in one line before anything is read or loaded, then every cell still to run is checked
against the model's config, its policy and the prompts' source before anything is written or the weights load.
The cells, their files, resuming and the summary are :mod:`rolecall.eval.grid`'s. ``benchmarks/quality.py`` runs
this command under its own name.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from rolecall.cli.common import (
    add_model,
    add_prompt_arguments,
    at_least,
    check_policy,
    check_prompt_arguments,
    eval_settings,
    parse_params,
)
from rolecall.eval.grid import BUDGETS, POLICIES, Cell, Grid


def add_arguments(parser: argparse.ArgumentParser) -> None:
    import torch

    add_model(parser)
    parser.add_argument("--policies", nargs="+", default=None,
                        help=f"subset of {', '.join(POLICIES)} (default: every one whose manifest is given)")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS), help="token budgets")
    parser.add_argument("--delta", default=None, help="DELTA manifest (layers.role), e.g. from calibrate-delta")
    parser.add_argument("--measure", action="store_true", default=None,
                        help="also measure per-layer attention recall (the transformers path; on a GPU the policies "
                        "otherwise decode on the engine)")
    parser.add_argument("--delta-recall", default=None, help="a second DELTA manifest (calibrate-delta --select recall)")
    parser.add_argument("--heads", action="append", metavar="NAME=PATH",
                        help="LycheeDecode heads manifest, repeatable (e.g. hardkuma=..., hardconcrete=..., sigmoid=...)")
    parser.add_argument("--lethe", default=None, help="manifest with layers.budget (default: the same budget every layer)")
    parser.add_argument("--vattention-epsilon", type=float, default=0.05, help="vAttention's ε (default 0.05)")
    parser.add_argument("--vattention-delta", type=float, default=0.05, help="vAttention's δ (default 0.05)")
    add_prompt_arguments(parser, passkey_words=5, alphabet="digits", limit=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--combined", action="store_true",
                        help="also the combined DELTA + vAttention policy (vattention on each DELTA manifest: heavy "
                        "hitters from the nearest Δ-layer's scores), rows vattention-delta[-recall]")
    parser.add_argument("--variant", action="append", metavar="POLICY:KEY=VALUE[,KEY=VALUE]",
                        help="extra rows: every row of POLICY again with these parameters, its label suffixed by "
                        "them (e.g. delta:per_head=true → delta-per_head); repeatable")
    parser.add_argument("--out", required=True, help="output folder; rerunning into it resumes")
    parser.add_argument("--summarize", action="store_true",
                        help="run nothing: rewrite the summary, tables and plots from the cells done in --out (cells "
                             "of this command not done there are left out and counted); no model loads")


def parse_heads(pairs: list[str] | None) -> list[tuple[str, str]]:
    """``--heads NAME=PATH`` values as (name, path) pairs; a value of another form: ``ValueError``."""
    heads = []
    for pair in pairs or []:
        name, sep, path = pair.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not path:
            raise ValueError(f"--heads {pair!r}: write it as NAME=PATH with NAME made of letters, digits, '_', '-', "
                             "e.g. --heads hardkuma=artifacts/m/heads.safetensors")
        heads.append((name, path))
    return heads


def parse_variants(specs: list[str] | None) -> list[tuple[str, dict[str, Any], str]]:
    """``--variant delta:per_head=true,num_pages=32`` → ``("delta", {"per_head": True, ...}, "-per_head-num_pages32")``:
    extra rows of a policy with these parameters on top of the budget's."""
    out = []
    for spec in specs or []:
        policy, sep, pairs = spec.partition(":")
        if not sep or policy not in POLICIES or not pairs:
            raise ValueError(f"--variant {spec!r}: write it as POLICY:KEY=VALUE[,KEY=VALUE], POLICY one of "
                             f"{', '.join(POLICIES)}, e.g. --variant delta:per_head=true")
        try:
            extra = parse_params(pairs.split(","))
        except ValueError as e:
            raise ValueError(f"--variant {spec!r}: {e}") from None
        suffix = "".join(f"-{k}" if v is True else f"-{k}{v}" for k, v in extra.items())
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", suffix):
            raise ValueError(f"--variant {spec!r}: values must be letters, digits, '_', '.' or '-' (they name files)")
        out.append((policy, extra, suffix))
    return out


def wanted_policies(args: argparse.Namespace, heads: list[tuple[str, str]]) -> list[str]:
    """``--policies`` (default: every policy whose manifest is given), each checked: known, its manifest given,
    on the engine for the reasoning suite, vattention kept for ``--combined`` (else ``ValueError``)."""
    from rolecall.runtime.policies import engine_policies

    engine = engine_policies() if args.suite == "reasoning" else POLICIES
    have = {"full": True, "delta": bool(args.delta or args.delta_recall), "lychee": bool(heads), "lethe": True,
            "vattention": True, "quest": True}
    wanted = args.policies or [p for p in POLICIES if have[p] and p in engine]
    off = [p for p in wanted if p in POLICIES and p not in engine]
    if off:
        raise ValueError(f"--suite reasoning runs on the engine: leave {' and '.join(off)} out of --policies")
    if args.combined and not ("vattention" in wanted and (args.delta or args.delta_recall)):
        raise ValueError("--combined runs vAttention on a DELTA manifest: give --delta (or --delta-recall) and keep "
                         "vattention in --policies")
    for p in wanted:
        if p not in POLICIES:
            raise ValueError(f"--policies: unknown policy {p!r}; choose from {', '.join(POLICIES)}")
        if not have[p]:
            flag = {"delta": "--delta (or --delta-recall)", "lychee": "--heads NAME=PATH"}[p]
            raise ValueError(f"policy {p} needs {flag}; give the manifest or leave {p} out of --policies")
    return wanted


def table_rows(args: argparse.Namespace) -> list[tuple[str, str, str | None, dict[str, Any]]]:
    """(label, policy, manifest, extra parameters) of each row, in table order: each policy's rows (one per DELTA
    manifest, heads manifest or, with ``--combined``, vAttention on each DELTA manifest), each followed by its
    ``--variant`` rows."""
    heads = parse_heads(args.heads)
    wanted = wanted_policies(args, heads)
    deltas = [(label, path) for label, path in (("delta", args.delta), ("delta-recall", args.delta_recall)) if path]
    base: list[tuple[str, str, str | None]] = []
    for p in (p for p in POLICIES if p in wanted):
        if p == "delta":
            base += [(label, p, path) for label, path in deltas]
        elif p == "lychee":
            base += [(f"lychee-{name}", p, path) for name, path in heads]
        elif p == "vattention":  # --combined: also DELTA + vAttention on each DELTA manifest
            base += [(p, p, None)] + [(f"vattention-{label}", p, path) for label, path in deltas if args.combined]
        else:
            base.append((p, p, args.lethe if p == "lethe" else None))
    rows = []
    variants = parse_variants(args.variant)
    for label, policy, manifest in base:
        rows.append((label, policy, manifest, {}))
        rows += [(label + suffix, policy, manifest, extra) for p, extra, suffix in variants if p == policy]
    return rows


def build_cells(args: argparse.Namespace) -> list[Cell]:
    """The grid's cells, in table order: each row at each budget (``full`` once); a policy asked for by name
    without the manifest it needs, or a parameter its policy refuses, is a ``ValueError`` before the model loads."""
    from rolecall.eval.budgets import policy_params
    from rolecall.runtime.policies import PolicyError, get_policy

    cells = []
    for label, policy, manifest, extra in table_rows(args):
        if policy == "full":
            cells.append(Cell(label, policy, manifest, None))
            continue
        cells += [Cell(label, policy, manifest, b, {**policy_params(policy, b, args.vattention_epsilon,
                                                                    args.vattention_delta), **extra})
                  for b in args.budgets]
    for cell in cells:
        try:
            get_policy(cell.policy, **cell.params)  # bad values fail here, before the model loads
        except PolicyError as e:
            raise ValueError(f"{cell.name}: {e}") from None
    return cells


def check_arguments(args: argparse.Namespace, parser) -> None:
    """The flags, with every value that the flags alone decide refused in one line (``parser.error``) before
    anything is read or loaded: the output folder, the prompts' settings, the cells and their manifest files, the
    dtype. Sets ``args.grid`` (:class:`rolecall.eval.grid.Grid`)."""
    import torch

    parser.check_writable(args.out, "--out", folder=True)  # the cells are written into it as they finish
    try:
        check_prompt_arguments(args)
    except ValueError as e:
        parser.error(str(e))
    at_least(parser, args, budgets=1, lengths=1, limit=1,
             max_new_tokens=(2, "the first token comes from the dense prefill"))
    if not all(0 <= d <= 1 for d in args.depths):
        parser.error(f"--depths takes places in the context from 0 (its start) to 1 (its end), got "
                     f"{' '.join(map(str, args.depths))}")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        parser.error(f"--dtype {args.dtype!r} is not a torch dtype; use float32, bfloat16 or float16")
    try:
        reasoning = args.suite == "reasoning"
        settings = None if reasoning else eval_settings(args)
        new_tokens(args)
        cells = build_cells(args)
    except ValueError as e:
        parser.error(str(e))
    missing = next((c for c in cells if c.manifest and not Path(c.manifest).is_file()), None)
    if missing is not None:
        parser.error(f"{missing.name}: no manifest file at {missing.manifest}; give the path that calibrate-delta or "
                     "train-heads wrote")
    args.grid = Grid(model=args.model, out=Path(args.out), cells=cells, budgets=args.budgets, settings=settings,
                     reasoning={"source": args.reasoning_source, "limit": args.limit,
                                "max_new_tokens": args.max_new_tokens} if reasoning else None,
                     device=args.device, dtype=args.dtype, rope_theta=args.rope_theta,
                     trust_remote_code=args.trust_remote_code, measure=args.measure, batch_size=args.batch_size,
                     allow_long_context=args.allow_long_context)


def new_tokens(args: argparse.Namespace) -> int:
    """The most tokens a prompt generates (RULER tasks carry their own budget; unknown tasks: ``ValueError``)."""
    from rolecall.eval import suite_new_tokens

    return args.max_new_tokens if args.suite == "reasoning" else suite_new_tokens(eval_settings(args))


def check_source(args: argparse.Namespace) -> None:
    """The prompts' source read before anything loads, as building the prompts will read it: the haystack corpus
    (``--source``), LongBench's copy (``--data``) or the reasoning prompts (``--reasoning-source``); a prompt file
    is checked with the prompt flags. Missing or unusable: ``ValueError`` in one line naming the flag."""
    if args.suite == "reasoning":
        from rolecall.data.reasoning import load_problems

        flag, read = "--reasoning-source", lambda: load_problems(args.reasoning_source, args.limit)
    elif args.prompts:
        return
    elif args.suite == "longbench":
        from rolecall.data.longbench import TASKS, load_tasks

        flag, read = "--data", lambda: load_tasks(args.tasks or tuple(TASKS), args.data, limit=args.samples_per_cell)
    else:
        from rolecall.data.corpora import load_corpus

        flag, read = "--source", lambda: load_corpus(args.source).fingerprint()
    try:
        read()
    except (ValueError, OSError) as e:
        raise ValueError(str(e) if str(e).startswith(flag) else f"{flag}: {e}") from None


def check_cells(cells: list[Cell], args: argparse.Namespace):
    """Each cell's manifest against the model's config (read without its weights) and against its policy, before
    any cell runs: a grid stops here in one line (``ValueError``), not when it reaches that cell. Returns the
    config."""
    from rolecall.core.manifest import RoleManifest
    from rolecall.core.models import load_config

    config = load_config(args.model, trust_remote_code=args.trust_remote_code)
    manifests = {path: RoleManifest.load(path) for path in {c.manifest for c in cells if c.manifest}}
    for cell in cells:
        try:
            check_policy(cell.policy, cell.params, manifests.get(cell.manifest), config)
        except ValueError as e:
            raise ValueError(f"{cell.name}: {e}") from None
    return config


def prepare(args: argparse.Namespace, todo: list[Cell]) -> tuple[Any, Any]:
    """The tokenizer and the prompts the cells still to run need, after every check (a device this machine
    lacks, the haystack source, the cells' settings, lengths past the model's context: one line each, before
    anything is written or the weights load)."""
    import torch

    from rolecall.core.models import context_limit, load_tokenizer
    from rolecall.eval import suite_prompts

    reasoning = args.suite == "reasoning"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device here, and {len(todo)} cells are not done; use --device cpu")
    check_source(args)
    limit, new = context_limit(check_cells(todo, args)), new_tokens(args)
    if limit and not (args.prompts or reasoning) and max(args.lengths) + new > limit:
        too_long = f"--lengths: {max(args.lengths)} + {new} new tokens exceeds the model's {limit} positions"
        if not args.allow_long_context:
            raise ValueError(f"{too_long}; use shorter lengths, or --allow-long-context with --rope-theta")
        print(f"warning: {too_long} (--allow-long-context)", file=sys.stderr)
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    # a length too short for a task's question, a corpus too small: one line, no cell run
    samples = None if reasoning else suite_prompts(tokenizer, args.grid.settings)
    return tokenizer, samples


def run_checked(args: argparse.Namespace) -> int:
    """The grid of flags :func:`check_arguments` passed: the cells done in ``--out`` resumed (or refused when made
    with other settings), the rest checked and run, then the summary; ``args.command_line`` goes into
    ``COMMAND.txt``."""
    from rolecall.core.models import load_model
    from rolecall.eval.grid import open_grid, resumed, run_cells, write_summary

    grid = args.grid
    grids, done = resumed(grid)
    resumed_count = len(done)
    if args.summarize and not done:
        raise ValueError(f"--summarize: none of this command's {len(grid.cells)} cells is done in {grid.out / 'cells'}; "
                         "run it without --summarize first")
    tokenizer = samples = model = None
    todo = [] if args.summarize else [c for c in grid.cells if c.name not in done]  # a finished grid: the summary only
    if todo:  # what the cells need, checked and built before anything is written or the weights load
        tokenizer, samples = prepare(args, todo)
    open_grid(grid.out, args.command_line, bool(todo))
    if todo:
        model = load_model(grid.model, dtype=grid.dtype, trust_remote_code=grid.trust_remote_code,
                           rope_theta=grid.rope_theta).to(grid.device)
    rows = run_cells(grid, todo, done, grids, model, tokenizer, samples)
    write_summary(grid, rows, len(done), resumed_count, args.summarize)
    return 0


def run(args: argparse.Namespace) -> int:
    """``rolecall grid``: the flags checked (refused as the command's usage errors), then the grid run;
    ``COMMAND.txt`` records the command line ``rolecall`` was given."""
    from rolecall.cli import Parser

    check_arguments(args, Parser(prog="rolecall grid"))
    return run_checked(args)
