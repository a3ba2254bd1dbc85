"""Reasoning prompts for calibration: the model answers them once and its traces are recorded.

Sources (a registry by name, selected by a string):

* ``champ`` (default): the 270 competition problems of CHAMP (MIT licence), read from the JSON file that the
  PyPI package ``champ-dataset==1.0.0`` carries, with their reference answers.
* ``jsonl:PATH`` (or any path ending in ``.jsonl``): one ``{"prompt": ..., "answer": ...}`` per line.
* ``arithmetic[:N]``: N (default 32) small generated word problems with exact answers, for tests.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rolecall.core.atomic import write_text
from rolecall.core.registry import Registry
from rolecall.data.corpora import ASSETS_HINT, CorpusError, CorpusNotFoundError
from rolecall.data.jsonl import iter_jsonl
from rolecall.data.tokens import (
    TokenDataset,
    cache_root,
    cached,
    has_chat_template,
    sha256_text,
    tokenizer_fingerprint,
)

INSTRUCTION = "Think it through step by step, then give the final answer in \\boxed{}."


@dataclass(frozen=True)
class Problem:
    name: str
    prompt: str
    answer: str | None = None


PROBLEM_SOURCES = Registry("reasoning source", CorpusError, choices="champ, arithmetic[:N] or jsonl:PATH",
                           lead="choose")
register_problems = PROBLEM_SOURCES.register


@register_problems("champ")
def champ_problems(arg: str = "") -> list[Problem]:
    try:
        dist = importlib.metadata.distribution("champ-dataset")
    except importlib.metadata.PackageNotFoundError:
        raise CorpusNotFoundError(f"reasoning source 'champ' ships in the package 'champ-dataset', which is not "
                                  f"installed; run: {ASSETS_HINT}") from None
    path = Path(str(dist.locate_file("champ_dataset/dataset_files/v0.json")))
    if not path.is_file():
        raise CorpusNotFoundError(f"reasoning source 'champ': {path} is missing; reinstall: {ASSETS_HINT}")
    return [Problem(*row) for row in _champ_rows(str(path))]


def _champ_rows(path: str) -> list[list[str]]:
    """(name, text, answer) of each problem. The file is 72 MB, mostly model transcripts; the three fields
    are kept in a small JSON under the cache, keyed by the file's size and modification time."""
    stat = Path(path).stat()
    small = cache_root() / f"champ-{stat.st_size}-{stat.st_mtime_ns}.json"
    if small.is_file():
        return json.loads(small.read_text(encoding="utf-8"))
    problems = json.loads(Path(path).read_text(encoding="utf-8"))["problems"]
    rows = [[key, p["_text"], p.get("_answer")] for key, p in problems.items()]
    write_text(small, json.dumps(rows))
    return rows


@register_problems("jsonl")
def jsonl_problems(arg: str) -> list[Problem]:
    path = Path(arg).expanduser()
    if not path.is_file():
        raise CorpusNotFoundError(f"reasoning source jsonl:{arg}: no such file; pass jsonl:/path/prompts.jsonl "
                                  'with one {"prompt": "..."} per line')
    out = []
    for n, row in iter_jsonl(path, CorpusError, '{"prompt": ...}'):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise CorpusError(f"{path}: line {n} has no non-empty string field 'prompt'")
        answer = row.get("answer")
        out.append(Problem(str(row.get("id", n)), row["prompt"], None if answer is None else str(answer)))
    if not out:
        raise CorpusError(f"{path} holds no prompts; write one {{\"prompt\": ...}} object per line")
    return out


NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Femi", "Gita", "Hugo")
ITEMS = ("apples", "marbles", "stamps", "pencils", "cards", "shells")


@register_problems("arithmetic")
def arithmetic_problems(arg: str = "") -> list[Problem]:
    """Word problems of three shapes with small whole numbers; the same list for the same N every time."""
    try:
        count = int(arg) if arg else 32
    except ValueError:
        raise CorpusError(f"arithmetic:{arg}: the argument is the number of problems, e.g. arithmetic:16") from None
    if count < 1:
        raise CorpusError(f"arithmetic:{arg}: ask for at least one problem")
    rng = np.random.default_rng(1234)
    out = []
    for i in range(count):
        name, item = NAMES[rng.integers(len(NAMES))], ITEMS[rng.integers(len(ITEMS))]
        a, b, c = (int(x) for x in rng.integers(2, 20, size=3))
        shape = i % 3
        if shape == 0:
            d = int(rng.integers(1, a + b * c))
            text = (f"{name} has {a} {item}, buys {b} boxes with {c} {item} in each, and then gives away {d} {item}. "
                    f"How many {item} does {name} have now?")
            answer = a + b * c - d
        elif shape == 1:
            text = (f"A train runs at {a * 10} km per hour for {b} hours and then at {c * 10} km per hour for {a} "
                    "hours. How many kilometres does it run in total?")
            answer = a * 10 * b + c * 10 * a
        else:
            total = a * b * c
            text = (f"{name} shares {total} {item} equally among {a} bags, then splits the {item} of one bag equally "
                    f"among {b} friends. How many {item} does each friend get?")
            answer = total // a // b
        out.append(Problem(f"arithmetic-{i}", text, str(answer)))
    return out


def load_problems(source: str = "champ", limit: int | None = None) -> list[Problem]:
    """Problems (name, prompt, reference answer or None) from a source spec; the first ``limit`` of them."""
    source = str(source)
    name, _, arg = source.partition(":")
    if name not in PROBLEM_SOURCES and source.endswith(".jsonl"):
        name, arg = "jsonl", source
    load = PROBLEM_SOURCES.lookup(name, shown=source)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be positive or None, got {limit}")
    return load(arg)[:limit]


def load_prompts(source: str = "champ", limit: int | None = None, instruction: str | None = INSTRUCTION) -> list[str]:
    """Prompt texts (not yet chat-formatted): each problem followed by ``instruction`` when given."""
    return [f"{p.prompt}\n\n{instruction}" if instruction else p.prompt for p in load_problems(source, limit)]


def format_prompt(tokenizer, text: str, system: str | None = None) -> str:
    """``text`` as the user turn of the tokenizer's chat template, ready for the assistant to answer; the text
    itself plus a newline when the tokenizer has no template."""
    if not has_chat_template(tokenizer):
        return f"{system}\n\n{text}\n" if system else f"{text}\n"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def build_reasoning_dataset(tokenizer, source: str = "champ", limit: int | None = None,
                            instruction: str | None = INSTRUCTION, system: str | None = None,
                            cache: bool = True) -> TokenDataset:
    """Tokenised, chat-formatted prompts. Samples: ``input_ids`` (1-D LongTensor, the prompt to generate from),
    ``labels`` (all −100: a prompt has no targets), ``name``, ``prompt`` (text) and ``answer`` (or None)."""
    problems = load_problems(source, limit)
    texts = [f"{p.prompt}\n\n{instruction}" if instruction else p.prompt for p in problems]
    key = {"source": source, "limit": limit, "system": system, "tokenizer": tokenizer_fingerprint(tokenizer),
           "content": sha256_text(json.dumps(texts))}

    def build() -> list[dict[str, Any]]:
        samples = []
        for p, text in zip(problems, tqdm(texts, desc="reasoning prompts", leave=False)):
            formatted = format_prompt(tokenizer, text, system)
            # A chat template already writes any BOS it needs; a bare prompt gets the tokenizer's usual prefix.
            ids = tokenizer.encode(formatted, add_special_tokens=not has_chat_template(tokenizer))
            ids = torch.tensor(ids, dtype=torch.long)
            samples.append({"input_ids": ids, "labels": torch.full_like(ids, -100), "name": p.name,
                            "prompt": text, "answer": p.answer})
        return samples

    return cached("reasoning", key, build, use_cache=cache)
