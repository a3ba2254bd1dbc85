"""``rolecall serve``: an OpenAI-compatible HTTP server with continuous batching, on the engine's scheduler.

The model (or, with ``--random-weights``, only its config) and the policy are checked, and the port is bound,
before any weight loads; then the engine serves one warm-up request, and one line says where the server listens.
SIGTERM drains: requests in flight finish, new ones get 503, then the command exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import threading
from typing import Any

from rolecall.cli.common import (
    add_common,
    add_long_context,
    chosen_device,
    chosen_dtype,
    load_placed,
    policy_inputs,
)
from rolecall.cli.plan import add_memory, check_memory_flags, plan_for
from rolecall.core.models import pad_token

SLOTS = {"cuda": 8, "cpu": 4}  # default --slots by device type


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every "
                        "interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port, "
                        "named in the ready line)")
    parser.add_argument("--slots", type=int, default=None, help="requests decoded together: the engine's rows, over "
                        "a pool of 16-token KV pages the memory plan sizes (a policy whose step reads the cache's "
                        "slots itself: each row holds --max-context tokens, as many as the pool holds) "
                        f"[{SLOTS['cuda']} on a GPU, {SLOTS['cpu']} on the CPU]")
    parser.add_argument("--no-paged-kv", dest="paged_kv", action="store_false", help="a contiguous KV cache of --slots "
                        "× --max-context tokens for every policy (the memory plan caps --slots), not the pool of pages")
    parser.add_argument("--max-context", type=int, default=None, metavar="N", help="the most tokens (prompt + "
                        "answer) one request may hold [the model's context, max_position_embeddings]")
    parser.add_argument("--served-model-name", default=None, metavar="NAME", help="the model name clients send and "
                        "see [--model as given]")
    parser.add_argument("--random-weights", action="store_true", help="the model's config only, with random weights "
                        "(load tests; --model may be a bare config.json); text needs a tokenizer beside the config, "
                        "else prompts must be token ids")
    add_long_context(parser)
    add_memory(parser)


def check_flags(args: argparse.Namespace) -> None:
    """What the flags alone say is wrong, refused in one line (``ValueError``) before anything loads."""
    from rolecall.cli.common import parse_params
    from rolecall.runtime.session import SESSION_PARAMS

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"rolecall serve needs {' and '.join(missing)}, not installed here: "
                         "pip install 'rolecall[serve]'")
    if args.slots is not None and args.slots < 1:
        raise ValueError(f"--slots {args.slots}: serve at least 1 request at a time")
    check_memory_flags(args)
    if args.max_context is not None and args.max_context < 2:
        raise ValueError(f"--max-context {args.max_context}: a request needs at least 2 positions (a prompt token "
                         "and an answer token)")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: give a port in [0, 65535] (0: any free port)")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name is empty: give the name clients send, or leave it out")
    if args.device_map:
        raise ValueError(f"--device-map {args.device_map}: the engine serves a model from one device; leave it out "
                         "(and pick the GPU with --device cuda:N)")
    params = parse_params(args.param)
    session = sorted(set(params) & set(SESSION_PARAMS) - {"min_context"})
    if session:
        raise ValueError(f"-p {session[0]}: rolecall serve always decodes on the engine and takes only the policy's "
                         "own parameters and min_context; leave it out")
    floor = params.get("min_context")
    if floor is not None and (not isinstance(floor, int) or isinstance(floor, bool) or floor < 0):
        raise ValueError(f"-p min_context={floor!r}: give a whole number of tokens ≥ 0 (0: always the policy's step; "
                         "left out: the measured crossover at --slots rows)")


def check_engine(args: argparse.Namespace, config: Any, policy: Any) -> None:
    """The model's family and the policy's static step, which the engine needs, and a step that serves rows of
    their own lengths, which the scheduler needs (``ValueError`` in one line)."""
    from rolecall.runtime.engine import ModelShape, static_step_of, unsupported
    from rolecall.runtime.engine.decoder import rows_refusal
    from rolecall.runtime.policies import PolicyError

    why = unsupported(config)
    if why:
        raise ValueError(f"--model {args.model}: {why}; rolecall serve runs the engine only")
    try:
        step = static_step_of(policy, ModelShape.from_config(config))
    except (NotImplementedError, PolicyError) as e:
        raise ValueError(f"--policy {args.policy}: {e}") from None
    why = rows_refusal(step)  # what Scheduler() checks, here before the weights load
    if why:
        raise ValueError(f"--policy {args.policy}: {why}")


def context_of(args: argparse.Namespace, config: Any) -> int:
    """``--max-context``, else the model's context; past the model's context only with --allow-long-context."""
    from rolecall.core.models import check_context, context_limit

    limit = context_limit(config, args.model)
    if args.max_context is None and limit is None:
        raise ValueError(f"--model {args.model}: its config does not say its context; give --max-context N")
    context = args.max_context or limit
    check_context(context, limit, what="--max-context", fix="lower --max-context",
                  allow_long=args.allow_long_context, prog="rolecall serve")
    return context


def planned_slots(args: argparse.Namespace, config: Any, policy: Any, device: str,
                  context: int) -> tuple[int, Any, int | None]:
    """The rows the memory plan allows, the plan, and the pages of the engine's pool (None: a contiguous cache).
    A policy whose step reads pages (:func:`~rolecall.runtime.engine.decoder.reads_pages`) takes ``--slots``, else
    the device's default, as rows over a pool of the plan's pages (at most what the rows hold at ``context`` tokens
    each, and the null page): requests are admitted by the pages they hold.
    Another reserves its whole context in every row: at most the requests of ``context`` tokens the pool holds. A
    plan that cannot hold one request, or ``--slots`` beyond what a contiguous cache holds, is refused in one line
    (``ValueError``) before any weight loads."""
    from rolecall.runtime.engine import ModelShape, static_step_of
    from rolecall.runtime.engine.decoder import reads_pages
    from rolecall.runtime.memory import ELEMENT_BYTES, GIB, device_memory, engine_pages, pages

    wanted = args.slots or SLOTS["cuda" if device.startswith("cuda") else "cpu"]
    size, name = device_memory(device)
    dtype = chosen_dtype(args, device)
    where = device if name == device else f"{device} ({name})"
    shape = ModelShape.from_config(config)
    paged = getattr(args, "paged_kv", True) and reads_pages(static_step_of(policy, shape))
    plan = plan_for(args, config, policy, context=context, dtype=dtype, device=where, device_bytes=size, rows=wanted,
                    whole_rows=not paged)
    why = plan.refusal()
    if why:
        raise ValueError(why)
    if paged:  # no more pages than the rows can ever hold at once
        pool = min(engine_pages(plan, shape, ELEMENT_BYTES[dtype], wanted), wanted * pages(context))
        if pool < pages(context):
            raise ValueError(f"--slots {wanted}: the rings of {wanted} rows leave {pool:,} pages of the pool, fewer "
                             f"than one request of --max-context {context:,} tokens needs; ask for fewer --slots")
        return wanted, plan, pool + 1  # and the null page
    if args.slots and args.slots > plan.max_concurrency:
        raise ValueError(f"--slots {args.slots}: each row holds --max-context {context:,} tokens of KV "
                         f"({plan.request_bytes / GIB:.2f} GiB) and the pool ({plan.pool_bytes / GIB:.2f} GiB) holds "
                         f"{plan.max_concurrency}; ask for --slots {plan.max_concurrency} or fewer, a smaller "
                         "--max-context, or more memory (--gpu-memory-utilization, --kv-cache-gib)")
    return min(wanted, plan.max_concurrency), plan, None


def tokenizer_of(args: argparse.Namespace) -> Any:
    """The model's tokenizer; with ``--random-weights`` None where the source has none (prompts are then ids)."""
    from pathlib import Path

    from rolecall.core.models import load_tokenizer

    source = str(Path(args.model).parent) if str(args.model).endswith("config.json") else args.model
    if not args.random_weights:
        return load_tokenizer(source, trust_remote_code=args.trust_remote_code)
    try:
        return load_tokenizer(source, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError):
        print(f"rolecall serve: {args.model} has no tokenizer: prompts must be token ids, and chat is refused",
              file=sys.stderr)
        return None


def eos_ids(config: Any, tokenizer: Any, generation: Any = None) -> list[int]:
    """The ids that end an answer: the generation config's, else the model config's, else the tokenizer's EOS."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for source in (generation, text, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


def warm_up(scheduler: Any) -> None:
    """One short request through the engine before the server says it is ready; an engine that fails here is
    refused in one line (``ValueError``)."""
    from rolecall.runtime.engine.scheduler import Request

    done, last = threading.Event(), []

    def emit(event: Any) -> None:
        if event.finish_reason is not None:
            last.append(event)
            done.set()

    scheduler.submit(Request((0,), max_new_tokens=2, ignore_eos=True), emit)
    done.wait()
    if last[0].finish_reason == "error":
        raise ValueError(f"the engine failed on a first request: {last[0].error}")


def run(args: argparse.Namespace) -> int:
    import contextlib

    import torch

    from rolecall.core.models import load_config
    from rolecall.runtime.engine import ModelShape, Weights, shared_weights
    from rolecall.runtime.engine.scheduler import Scheduler
    from rolecall.runtime.server import bind, create_app, serve
    from rolecall.runtime.session import bound_policy

    check_flags(args)
    device = chosen_device(args)
    config = load_config(args.model, trust_remote_code=args.trust_remote_code)
    params, manifest = policy_inputs(args, config)
    min_context = params.pop("min_context", None)  # the scheduler's, not the policy's
    policy = bound_policy(args.policy, manifest, config, **params)
    check_engine(args, config, policy)
    context = context_of(args, config)
    slots, plan, kv_pages = planned_slots(args, config, policy, device, context)
    with contextlib.ExitStack() as stack:
        sock = stack.enter_context(bind(args.host, args.port))  # a port in use is refused before the weights load
        for line in plan.lines():
            print(f"rolecall serve: plan: {line}", file=sys.stderr)
        tokenizer = tokenizer_of(args)
        if args.random_weights:
            dtype = getattr(torch, chosen_dtype(args, device))
            weights = Weights.random(ModelShape.from_config(config), device, dtype, positions=context)
            eos = eos_ids(config, tokenizer)
        else:
            model = load_placed(args)
            weights = stack.enter_context(shared_weights(model, positions=context))
            eos = eos_ids(config, tokenizer, model.generation_config)
        pad = pad_token(tokenizer) if tokenizer is not None else None
        pad = pad if pad is not None else (eos or [0])[0]
        try:
            scheduler = stack.enter_context(Scheduler(weights, policy, slots=slots, max_context=context,
                                                      tokenizer=tokenizer, eos_token_id=eos, pad_token_id=pad,
                                                      min_context=min_context, kv_pages=kv_pages,
                                                      paged=kv_pages is not None))
        except NotImplementedError as e:  # a policy the scheduler refuses: one line, as every refusal
            raise ValueError(f"--policy {args.policy}: {e}") from None
        warm_up(scheduler)
        name = args.served_model_name or args.model
        app = create_app(scheduler, model_name=name, tokenizer=tokenizer)

        def ready(port: int) -> None:
            kv = f", KV in {kv_pages - 1:,} pages of 16 tokens" if kv_pages else ""
            print(f"rolecall serve: {name} with policy {args.policy} on http://{args.host}:{port} ({slots} slots, "
                  f"context {context}{kv})", flush=True)

        serve(app, sock, ready=ready)
    return 0
