"""``rolecall decode``: generate with a manifest and a decode policy; print the text and what was read."""

from __future__ import annotations

import argparse

from runtime.eval_cli import add_common, parse_params


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--layers", action="store_true", help="also print the attended fraction of every layer")


def run(args: argparse.Namespace) -> int:
    import torch

    from runtime.session import attach
    from runtime.models import load_model, load_tokenizer
    from runtime.policies import get_policy

    params = parse_params(args.param)
    get_policy(args.policy, **params)  # bad names and values fail here, before the model loads
    model = load_model(args.model, dtype="float32")
    tokenizer = load_tokenizer(args.model)
    if args.chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with attach(model, args.manifest, args.policy, **params) as session, torch.no_grad():
        out = session.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                               do_sample=False, pad_token_id=pad)
    print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    summary = session.summary()
    fraction = summary["attended_fraction"]
    print(f"\nattended fraction {fraction:.3f} (policy {args.policy}, {ids.shape[1]} prompt tokens, "
          f"{out.shape[1] - ids.shape[1]} generated)" if fraction is not None else
          f"\nno decode step ran (policy {args.policy})")
    if args.layers:
        for layer in summary["layers"]:
            kept = f"  kept {layer['kept_fraction']:.3f}" if layer["kept_fraction"] is not None else ""
            read = layer["attended_fraction"]
            print(f"layer {layer['layer']:>3}  read {read:.3f}{kept}" if read is not None else f"layer {layer['layer']:>3}  dense")
    return 0
