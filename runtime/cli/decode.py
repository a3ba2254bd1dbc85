"""``rolecall decode``: generate with a manifest and a decode policy; stream the text and say what was read."""

from __future__ import annotations

import argparse
import sys

from runtime.cli.common import add_common, check_device_map, chosen_device, load_placed, policy_inputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sample", action="store_true", help="sample (default: greedy)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string, repeatable")
    parser.add_argument("--layers", action="store_true", help="also print the attended fraction of every layer "
                        "(measured on the transformers path)")


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


def run(args: argparse.Namespace) -> int:
    import time

    import torch
    from transformers import TextStreamer

    from runtime.engine.sampling import Sampling
    from runtime.models import load_config, load_tokenizer
    from runtime.session import attach

    class TimedStreamer(TextStreamer):
        """Streams the text and notes when each new token arrives (the first ``put`` is the prompt)."""

        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())
            super().put(value)

    if not args.prompt.strip() and not args.chat:
        raise ValueError("--prompt is empty: give the text to continue (or --chat, to answer an empty user turn)")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: generate at least 1 token")
    try:  # the sampling flags, checked as the engine's sampler checks them (the transformers path takes the same)
        Sampling(args.sample, args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:  # its message in the flags' names
        text = str(e).replace("use do_sample=False", "leave out --sample")
        for name in ("temperature", "top_k", "top_p", "seed"):
            text = text.replace(f"{name} must", f"--{name.replace('_', '-')} must")
        raise ValueError(text) from None
    trust = args.trust_remote_code
    device = chosen_device(args)
    check_device_map(args, "rolecall decode")
    # bad policies, parameters and manifests, and a manifest the policy or the model cannot use, fail before the
    # weights load
    params, manifest = policy_inputs(args, load_config(args.model, trust_remote_code=trust))
    tokenizer = load_tokenizer(args.model, trust_remote_code=trust)
    if args.chat:
        if tokenizer.chat_template is None:
            raise ValueError(f"--chat: {args.model} has no chat template (a base model); leave out --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    if not ids.shape[1]:
        raise ValueError(f"--prompt {args.prompt!r} is no token at all for this tokenizer; give some text")
    model = load_placed(args)
    ids = ids.to(model.device)
    if args.device_map:
        device = f"--device-map {args.device_map}"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if args.layers:
        params["record_recall"] = True  # per-layer statistics come from the measuring (transformers) path
    streamer = TimedStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                  do_sample=args.sample, pad_token_id=pad, streamer=streamer)
    if args.sample:
        kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.stop:
        kwargs.update(stop_strings=args.stop, tokenizer=tokenizer)
    with attach(model, manifest, args.policy, **params) as session, torch.no_grad():
        if args.sample and session.engine_reason(dict(kwargs, seed=args.seed)) is None:
            kwargs["seed"] = args.seed
        elif args.sample:
            torch.manual_seed(args.seed)
        streamer.times.append(time.perf_counter())  # the call begins (the prompt's put follows at once)
        out = session.generate(**kwargs)
    generated = out.shape[1] - ids.shape[1]
    last = session.last
    if last is not None:
        print(engine_line(last, device, ids.shape[1], args.policy), file=sys.stderr)
        return 0
    summary = session.summary()
    times = streamer.times[:1] + streamer.times[2:]  # the call's start, then one per new token (not the prompt)
    print(transformers_line(device, ids.shape[1], generated, times, summary["attended_fraction"], args.policy),
          file=sys.stderr)
    if args.layers:
        for layer in summary["layers"]:
            kept = f"  kept {layer['kept_fraction']:.3f}" if layer["kept_fraction"] is not None else ""
            read = layer["attended_fraction"]
            print(f"layer {layer['layer']:>3}  read {read:.3f}{kept}" if read is not None else f"layer {layer['layer']:>3}  dense")
    return 0
