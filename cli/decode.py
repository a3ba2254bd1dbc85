"""``rolecall decode``: generate with a manifest and a decode policy; stream the text and say what was read."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from rolecall.cli.common import (
    add_common,
    add_long_context,
    check_batch_size,
    check_device_map,
    check_sampling_flags,
    chosen_device,
    load_placed,
    one_at_a_time,
    policy_inputs,
)
from rolecall.core.atomic import check_writable, write_text
from rolecall.core.models import pad_token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text (streamed)")
    source.add_argument("--prompts", metavar="FILE", help='a JSONL file of {"prompt": ...} lines (other keys are '
                        "kept): decoded in batches of --batch-size, written to --out")
    parser.add_argument("--out", metavar="FILE", help="with --prompts: the JSONL file of completions, one line per "
                        "prompt in the file's order (finished batches are kept in FILE.partial meanwhile: a rerun "
                        "resumes there)")
    parser.add_argument("--batch-size", type=int, default=None, help="with --prompts: prompts decoded together on "
                        "the engine, similar lengths together [16 on a GPU, 1 elsewhere]")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sample", action="store_true", help="sample (default: greedy)")
    parser.add_argument("--temperature", type=float, help="with --sample [1.0]")  # None: not given (check_flags)
    parser.add_argument("--top-p", type=float, help="with --sample [1.0]")
    parser.add_argument("--top-k", type=int, help="with --sample; 0 = off [0]")
    parser.add_argument("--seed", type=int, help="with --sample [0]")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string, repeatable")
    parser.add_argument("--layers", action="store_true", help="also print the attended fraction of every layer "
                        "(measured on the transformers path)")
    add_long_context(parser)


def engine_line(last, device: str, prompt_tokens: int, policy: str) -> str:
    """The closing line of an engine decode: tokens, prefill time, speed, the context read, the cache held."""
    fraction = last.info["attended_fraction"]
    fallback = last.info["min_context"]
    note = f"; full attention below {fallback} tokens" if 0 < fallback < 1 << 40 else (
        "; full attention at every length (no measured crossover)" if fallback else "")
    return (f"\n[engine on {device}: {prompt_tokens} prompt tokens, {sum(map(len, last.tokens))} generated, "
            f"prefill {last.prefill_s * 1e3:.0f} ms, {last.steps / max(last.decode_s, 1e-9):.1f} tokens/s decoding; "
            f"policy {policy} read {fraction if fraction is not None else 1.0:.3f} of the context{note}; "
            f"KV cache {last.info['cache_bytes'] / 2**20:.1f} MiB]")


def transformers_line(device: str, prompt_tokens: int, generated: int, times: list[float], fraction, policy: str) -> str:
    """The closing line of a transformers-path decode: tokens, the time to the first new token (the prefill and
    one step), speed over the steps after it, the context read. ``times``: when the call began and when each
    new token reached the streamer."""
    timing = ""
    if len(times) > 1:
        timing = f", first token {(times[1] - times[0]) * 1e3:.0f} ms"
        if len(times) > 2:
            timing += f", {(len(times) - 2) / max(times[-1] - times[1], 1e-9):.1f} tokens/s decoding"
    read = (f"attended fraction {fraction:.3f} (policy {policy})" if fraction is not None else
            f"no decode step ran (policy {policy})")
    return f"\n[transformers path on {device}: {prompt_tokens} prompt tokens, {generated} generated{timing}; {read}]"


def chat_hint(tokenizer, chat: bool, empty: int, of: int) -> str | None:
    """A line for completions that ended without text (``empty`` of ``of``) on a model with a chat template whose
    prompts went in bare: an instruct model often ends at once on text outside its template."""
    if not empty or chat or tokenizer.chat_template is None:
        return None
    which = "the completion is" if of == 1 else f"{empty} of {of} completions are"
    return f"[{which} empty: this model has a chat template; --chat wraps each prompt in it as a user turn]"


def check_flags(args: argparse.Namespace) -> None:
    """What the flags alone say is wrong, refused in one line (``ValueError``) before anything loads; the sampling
    flags left out take :class:`~rolecall.runtime.engine.sampling.Sampling`'s defaults."""
    from dataclasses import fields

    from rolecall.runtime.engine.sampling import Sampling
    from rolecall.runtime.prompts import check_max_new_tokens

    if args.prompt is not None and not args.prompt.strip() and not args.chat:
        raise ValueError("--prompt is empty: give the text to continue (or --chat, to answer an empty user turn)")
    check_max_new_tokens(args.max_new_tokens, "--max-new-tokens")
    flags = {name: f"--{name.replace('_', '-')}" for name in ("temperature", "top_k", "top_p", "seed")}
    given = {flag: getattr(args, name) for name, flag in flags.items()}
    for field in fields(Sampling):
        if field.name in flags and getattr(args, field.name) is None:
            setattr(args, field.name, field.default)
    try:  # the sampling flags, checked as the engine's sampler checks them (the transformers path takes the same)
        Sampling(args.sample, args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:  # its message in the flags' names
        text = str(e).replace("use do_sample=False", "leave out --sample")
        for name, flag in flags.items():
            text = text.replace(f"{name} must", f"{flag} must")
        raise ValueError(text) from None
    check_sampling_flags(args.sample, given, "decoding is greedy")
    if args.prompts is None:
        if args.out or args.batch_size is not None:
            raise ValueError("--out and --batch-size go with --prompts FILE; --prompt's text is streamed")
        return
    if not args.out:
        raise ValueError(f"--prompts {args.prompts}: give --out FILE, the JSONL file the completions go to")
    if args.layers:
        raise ValueError("--layers prints the layers of one prompt's decode; leave it out with --prompts")
    if not Path(args.prompts).is_file():
        raise ValueError(f'--prompts {args.prompts}: no such file; give a JSONL file of {{"prompt": ...}} lines')
    check_writable(args.out, "--out")
    check_batch_size(args)


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """``text`` as token ids, wrapped in the chat template as a user turn with ``chat``."""
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def run(args: argparse.Namespace) -> int:
    from rolecall.core.models import context_limit, load_config, load_tokenizer
    from rolecall.core.tokens import vocab_size
    from rolecall.runtime.prompts import check_prompts

    check_flags(args)
    trust = args.trust_remote_code
    device = chosen_device(args)
    check_device_map(args, "rolecall decode")
    # bad policies, parameters and manifests, and a manifest the policy or the model cannot use, fail before the
    # weights load
    config = load_config(args.model, trust_remote_code=trust)
    params, manifest = policy_inputs(args, config)
    tokenizer = load_tokenizer(args.model, trust_remote_code=trust)
    if args.chat and tokenizer.chat_template is None:
        raise ValueError(f"--chat: {args.model} has no chat template (a base model); leave out --chat")
    if args.prompts:
        from rolecall.eval import prompt_rows

        rows = prompt_rows(args.prompts)
        texts = [(f"{args.prompts}:{line}: the prompt", row["prompt"]) for line, row in rows]
    else:
        rows, texts = [], [("--prompt", args.prompt)]
    prompts = [encode(tokenizer, text, args.chat) for _, text in texts]
    # the one check of prompts the Python API makes too (rolecall.runtime.prompts): a text that is no token at all, an id
    # past the model's vocabulary (a tokenizer of another model), a prompt and its new tokens past its context
    check_prompts(prompts, vocab_size=vocab_size(config), max_new_tokens=args.max_new_tokens,
                  context=context_limit(config, args.model), allow_long=args.allow_long_context,
                  warn_as="rolecall decode", opt_in="--allow-long-context", new_name="--max-new-tokens",
                  row_names=[where for where, _ in texts], fix="shorten the prompt or lower --max-new-tokens")
    if args.device_map:
        device = f"--device-map {args.device_map}"
    if args.prompts:
        return decode_file(args, params, manifest, tokenizer, rows, prompts, device)
    return decode_one(args, params, manifest, tokenizer, prompts[0], device)


def generate_kwargs(args: argparse.Namespace, tokenizer, pad: int) -> dict:
    """``session.generate``'s arguments that the flags give."""
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, pad_token_id=pad)
    if args.sample:
        kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.stop:
        kwargs.update(stop_strings=args.stop, tokenizer=tokenizer)
    return kwargs


def session_params(args: argparse.Namespace, params: dict) -> dict:
    """``attach()``'s keywords: the ``-p`` parameters, and ``--allow-long-context`` (the prompts were checked
    against the context, and warned about, before the model loaded)."""
    return {"allow_long_context": args.allow_long_context, **params}


def seeded(session, kwargs: dict, args: argparse.Namespace) -> None:
    """Sampling draws from ``--seed``: the engine's own counter-based draws, else torch's generator."""
    import torch

    if args.sample and session.engine_reason(dict(kwargs, seed=args.seed)) is None:
        kwargs["seed"] = args.seed
    elif args.sample:
        torch.manual_seed(args.seed)


def decode_one(args: argparse.Namespace, params: dict, manifest, tokenizer, prompt: list[int], device: str) -> int:
    """``--prompt``: stream the text, then one closing line (and each layer's read fraction with ``--layers``)."""
    import time

    import torch
    from transformers import TextStreamer

    from rolecall.runtime.session import attach

    class TimedStreamer(TextStreamer):
        """Streams the text and notes when each new token arrives (the first ``put`` is the prompt)."""

        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())
            super().put(value)

    model = load_placed(args)
    ids = torch.tensor([prompt], device=model.device)
    if args.layers:
        params["record_recall"] = True  # per-layer statistics come from the measuring (transformers) path
    streamer = TimedStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = dict(generate_kwargs(args, tokenizer, pad_token(tokenizer)), input_ids=ids,
                  attention_mask=torch.ones_like(ids), streamer=streamer)
    with attach(model, manifest, args.policy, **session_params(args, params)) as session, torch.no_grad():
        seeded(session, kwargs, args)
        streamer.times.append(time.perf_counter())  # the call begins (the prompt's put follows at once)
        out = session.generate(**kwargs)
    generated = out.shape[1] - ids.shape[1]
    empty = not tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    hint = chat_hint(tokenizer, args.chat, int(empty), 1)
    last = session.last
    if last is not None:
        print(engine_line(last, device, ids.shape[1], args.policy), file=sys.stderr)
    else:
        summary = session.summary()
        times = streamer.times[:1] + streamer.times[2:]  # the call's start, then one per new token (not the prompt)
        print(transformers_line(device, ids.shape[1], generated, times, summary["attended_fraction"], args.policy),
              file=sys.stderr)
    if hint:
        print(hint, file=sys.stderr)
    if last is None and args.layers:
        for layer in summary["layers"]:
            kept = f"  kept {layer['kept_fraction']:.3f}" if layer["kept_fraction"] is not None else ""
            read = layer["attended_fraction"]
            print(f"layer {layer['layer']:>3}  read {read:.3f}{kept}" if read is not None else f"layer {layer['layer']:>3}  dense")
    return 0


def _file_plan(args: argparse.Namespace, params: dict, prompts: list[list[int]], size: int) -> tuple[list, Any]:
    """``--prompts``' batches (up to ``size`` prompts of similar lengths: less padding) and the checkpoint in
    ``--out``.partial that keeps the finished ones: a rerun with the same flags resumes there (another
    ``--batch-size`` keeps the finished batches), one with other flags is refused."""
    from rolecall.eval import Checkpoint, resume_plan

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    plan = [order[i:i + size] for i in range(0, len(order), size)]
    digest = hashlib.sha256
    header = {"model": args.model, "dtype": args.dtype, "policy": args.policy, "params": params,
              "manifest": digest(Path(args.manifest).read_bytes()).hexdigest() if args.manifest else None,
              "prompts": digest(json.dumps(prompts).encode()).hexdigest(), "max_new_tokens": args.max_new_tokens,
              "sample": args.sample, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
              "seed": args.seed, "stop": args.stop}
    checkpoint = Checkpoint(f"{args.out}.partial", header, plan)
    plan = resume_plan(plan, checkpoint.finished())
    checkpoint.adopt(plan)
    return plan, checkpoint


def _write_file_output(args: argparse.Namespace, rows: list, prompts: list[list[int]], plan: list, todo: int,
                       checkpoint: Any, tokenizer: Any, where: str, size: int, generated: float, read: float,
                       wall: float) -> None:
    """Write ``--out`` (each row's own keys, then its completion and counts, in the file's order), remove the
    checkpoint, and say in one line where the ``todo`` batches decoded and how fast (with a chat-template hint
    when completions came back empty)."""
    finished = {r["prompt"]: r for entry in checkpoint.done.values() for r in entry["rows"]}
    lines = [json.dumps({**row, **{key: v for key, v in finished[i].items() if key != "prompt"}}, ensure_ascii=False)
             for i, (_, row) in enumerate(rows)]
    write_text(args.out, "\n".join(lines) + "\n")
    checkpoint.path.unlink()

    def batches(n: int) -> str:
        return f"{n} batch{'' if n == 1 else 'es'}"

    speed = (f", {int(generated):,} generated in {wall:.1f} s: {generated / max(wall, 1e-9):.1f} tokens/s; policy "
             f"{args.policy} read {read / generated:.3f} of the context") if todo and generated else ""
    kept = f" ({batches(len(plan) - todo)} kept from {checkpoint.path.name})" if todo < len(plan) else ""
    print(f"[{where}: {len(prompts)} prompts in {batches(len(plan))} of up to {size}{kept}{speed}; wrote "
          f"{args.out}]", file=sys.stderr)
    hint = chat_hint(tokenizer, args.chat, sum(not r["completion"].strip() for r in finished.values()), len(prompts))
    if hint:
        print(hint, file=sys.stderr)


def decode_file(args: argparse.Namespace, params: dict, manifest, tokenizer, rows: list, prompts: list[list[int]],
                device: str) -> int:
    """``--prompts``: batches of similar lengths, each finished batch kept in ``--out``.partial (a rerun with the
    same flags resumes there; one with other flags is refused), then ``--out`` in the file's order: each row's
    own keys, then ``completion``, ``prompt_tokens``, ``new_tokens`` and ``finish`` (``eos``, ``stop``,
    ``length``). No timings in the file: the same flags give the same bytes."""
    import time

    import torch
    from tqdm.auto import tqdm

    from rolecall.runtime.engine import pad_left, padding_mask
    from rolecall.runtime.engine.generate import answer_end
    from rolecall.runtime.session import attach

    size = args.batch_size or (1 if one_at_a_time(args) else 16)
    plan, checkpoint = _file_plan(args, params, prompts, size)
    todo = [k for k in range(len(plan)) if k not in checkpoint.done]
    pad = pad_token(tokenizer)
    model = load_placed(args)
    gc = model.generation_config
    eos = gc.eos_token_id if gc.eos_token_id is not None else tokenizer.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    kwargs = generate_kwargs(args, tokenizer, pad)
    generated = read = 0.0
    engine = False
    start = time.perf_counter()
    with attach(model, manifest, args.policy, **session_params(args, params)) as session, torch.no_grad(), tqdm(
            total=sum(len(plan[k]) for k in todo), desc="prompts", unit="prompt", disable=None) as bar:
        seeded(session, kwargs, args)
        for k in todo:
            ids, pads = pad_left([prompts[i] for i in plan[k]], pad, model.device)
            mask = padding_mask(pads, ids.shape[1], ids.device)
            out = session.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, ids.shape[1]:].tolist()
            done = []
            for i, row in zip(plan[k], out):
                end, why = answer_end(row, eos, args.stop, tokenizer)
                done.append({"prompt": i, "completion": tokenizer.decode(row[:end], skip_special_tokens=True),
                             "prompt_tokens": len(prompts[i]), "new_tokens": end, "finish": why})
            checkpoint.add({"batch": k, "rows": done})
            new = sum(r["new_tokens"] for r in done)
            if session.last is not None:  # the engine: its fraction read over this batch's steps
                engine = True
                read += new * (session.last.info["attended_fraction"] or 1.0)
            generated += new
            bar.update(len(plan[k]))
        if not engine and todo:
            read = generated * (session.summary()["attended_fraction"] or 1.0)
    _write_file_output(args, rows, prompts, plan, len(todo), checkpoint, tokenizer,
                       f"{'engine' if engine else 'transformers path' if todo else 'nothing left to decode'} on {device}",
                       size, generated, read, time.perf_counter() - start)
    return 0
