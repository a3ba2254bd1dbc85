"""Sanity check that passkey prompts are well formed: does a model retrieve the passkeys with full attention?

    python -m rolecall.data.check_retrieval --model smollm2-135m --lengths 1000 2000 4000 --samples 3 --out retrieval.json

Greedy decoding reproduces an answer exactly iff the argmax at every answer position, fed the true prefix,
is the answer's next token; so one teacher-forced forward pass per sample scores all of its passkeys, with
earlier answers in context as the trainer sees them. ``--generate`` also runs ``generate`` on the first
answer of each sample and checks that it agrees. Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rolecall.cli import Parser
from rolecall.data.passkey import answer_prompt, build_niah_dataset, build_passkey_dataset, passkey_correct


@torch.no_grad()
def answer_hits(model, sample) -> tuple[list[bool], float, list[bool]]:
    """Per answer: exact greedy match; the fraction of answer tokens whose argmax is right; and per answer
    whether its first token is right (the model found the passkey, whether or not it then copies it well)."""
    spans = sample["answer_spans"].tolist()
    ids = sample["input_ids"][: spans[-1][1]].unsqueeze(0)
    positions = torch.tensor([t - 1 for a, b in spans for t in range(a, b)])
    logits = model(input_ids=ids, logits_to_keep=positions).logits[0]  # [n_answer_tokens, V]
    right = logits.argmax(-1) == ids[0, positions + 1]
    hits, first, at = [], [], 0
    for a, b in spans:
        hits.append(bool(right[at:at + b - a].all()))
        first.append(bool(right[at]))
        at += b - a
    return hits, float(right.float().mean()), first


@torch.no_grad()
def generated_first_answer(model, tokenizer, sample) -> str:
    a, b = sample["answer_spans"][0].tolist()
    prompt = answer_prompt(sample, 0).unsqueeze(0)
    out = model.generate(prompt, max_new_tokens=b - a, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, prompt.shape[1]:])


def run(model_name: str, lengths: list[int], samples: int, words: int, chat: bool, generate: bool,
        num_passkeys: int, depths: list[float], alphabet: str = "nato") -> dict:
    from rolecall.core.models import load_model, load_tokenizer

    tokenizer, model = load_tokenizer(model_name), load_model(model_name)
    results: dict = {"model": model_name, "chat_template": chat, "passkey_words": words, "alphabet": alphabet,
                     "device": "cpu",
                     "torch_threads": torch.get_num_threads(), "multi": [], "single": []}
    for n in lengths:
        ds = build_passkey_dataset(tokenizer, lengths=(n, n), num_samples=samples, num_passkeys=num_passkeys,
                                   passkey_words=words, seed=0, split="eval", chat_template=chat, alphabet=alphabet)
        for s in tqdm(ds, desc=f"{num_passkeys} passkeys, context {n}", leave=False):
            t = time.perf_counter()
            hits, token_acc, first = answer_hits(model, s)
            row = {"context_length": n, "total_tokens": len(s["input_ids"]), "hits": hits, "token_acc": token_acc,
                   "first_token": first, "seconds": round(time.perf_counter() - t, 2)}
            if generate:
                text = generated_first_answer(model, tokenizer, s)
                row["generated_first"] = text
                row["generate_agrees"] = passkey_correct(text, s["answers"][0]) == hits[0]
            results["multi"].append(row)
    grid = build_niah_dataset(tokenizer, lengths=lengths, depths=depths, samples_per_cell=samples,
                              passkey_words=words, seed=0, chat_template=chat, alphabet=alphabet)
    for s in tqdm(grid, desc="needle grid", leave=False):
        hits, token_acc, first = answer_hits(model, s)
        row = {"context_length": s["context_length"], "depth": s["depth"], "hit": hits[0], "token_acc": token_acc,
               "first_token": first[0]}
        if generate:
            text = generated_first_answer(model, tokenizer, s)
            row["generate_agrees"] = passkey_correct(text, s["answer"]) == hits[0]
        results["single"].append(row)
    return results


def summary(results: dict) -> str:
    lines = [f"model {results['model']}, chat template {results['chat_template']}, "
             f"{results['passkey_words']}-{'digit' if results['alphabet'] == 'digits' else 'word'} passkeys, CPU"]
    lines.append("context | multi: passkeys retrieved | first token | token acc | "
                 "single: prompts retrieved | first token | token acc")
    for n in sorted({r["context_length"] for r in results["multi"]}):
        multi = [r for r in results["multi"] if r["context_length"] == n]
        single = [r for r in results["single"] if r["context_length"] == n]
        got = sum(sum(r["hits"]) for r in multi)
        total = sum(len(r["hits"]) for r in multi)
        found = sum(sum(r.get("first_token", [])) for r in multi)
        lines.append(f"{n:>7} | {got}/{total} | {found}/{total} | {sum(r['token_acc'] for r in multi) / len(multi):.3f} | "
                     f"{sum(r['hit'] for r in single)}/{len(single)} | {sum(r.get('first_token', 0) for r in single)}/"
                     f"{len(single)} | {sum(r['token_acc'] for r in single) / len(single):.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000])
    p.add_argument("--samples", type=int, default=3, help="samples per length (and per grid cell)")
    p.add_argument("--passkeys", type=int, default=10)
    p.add_argument("--words", type=int, default=32, help="words per passkey (digits with --alphabet digits)")
    p.add_argument("--alphabet", choices=["nato", "digits"], default="nato")
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    p.add_argument("--generate", action="store_true", help="also check greedy generate on the first answer")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    results = run(a.model, a.lengths, a.samples, a.words, a.chat, a.generate, a.passkeys, a.depths, a.alphabet)
    print(summary(results))
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
