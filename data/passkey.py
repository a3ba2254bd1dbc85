"""Passkey-in-haystack prompts: the training data of DuoAttention, which LycheeDecode follows, and a
single-passkey needle-in-a-haystack grid for evaluation.

Training sample (``build_passkey_dataset``): a haystack of ``context_length`` tokens cut from a corpus on
token boundaries of the target tokenizer; ``num_passkeys`` passkeys, each ``passkey_words`` words drawn from
the NATO spelling alphabet, inserted at sorted depths drawn uniformly from ``depth_range`` (0.05–0.95), each
in a sentence that names its ordinal ("the third passkey"); after the text, one question per passkey in
order, each followed by its answer. Only the answers' passkey tokens carry labels; everything else is −100.
As in DuoAttention, the context length counts haystack tokens: needles, questions and answers come on top.
Lengths are spread over ``lengths`` by stratified sampling, and everything is a function of the seed and
split, so a sample is the same on every machine.

Evaluation grid (``build_niah_dataset``): one passkey per prompt at each (length, depth) cell; here a length
is the whole prompt (everything before the answer), so a grid can run up to a model's context limit.

Both take ``alphabet="digits"`` for numeric passkeys (``passkey_words`` digits), the classic single-key test
that small models pass long before they can copy 32 random words. Prompts are plain text by default, as in
DuoAttention; ``chat_template=True`` puts each question in a user turn and each answer in an assistant turn.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rolecall.data import tokens as tk
from rolecall.data.corpora import Corpus, load_corpus
from rolecall.data.haystack import POOL_TOKENS, Haystack, load_haystack
from rolecall.data.tokens import Piece, encode, text_piece

NATO = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett", "kilo",
        "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor",
        "whiskey", "xray", "yankee", "zulu")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
            "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
            "eighteenth", "nineteenth", "twentieth")
SPLITS = {"train": 0, "eval": 1}


def _name(k: int, count: int) -> str:
    """'the third passkey', or 'the passkey' when there is only one."""
    return f"the {ORDINALS[k]} passkey" if count > 1 else "the passkey"


def _intro(count: int) -> str:
    if count == 1:
        return "Read the book below. A passkey is hidden in it; remember it, you will be asked for it after the book.\n\n<book>\n"
    return (f"Read the book below. {count} passkeys are hidden in it; remember each of them, you will be asked "
            "for them after the book.\n\n<book>\n")


BOOK_END = "\n</book>\n\n"


def needle_text(k: int, count: int) -> str:
    """The words before passkey ``k`` inside the haystack (the passkey follows, then '.'). The answer repeats
    the same "passkey is:" so that a model can find the passkey by matching it."""
    return f"\n\nRemember this: {_name(k, count)} is:"


def question_text(k: int, count: int) -> str:
    return f"What is {_name(k, count)}?"


def answer_lead(k: int, count: int) -> str:
    return f"{_name(k, count)[0].upper()}{_name(k, count)[1:]} is:"


ALPHABETS = ("nato", "digits")


def make_passkey(rng: np.random.Generator, words: int, alphabet: str = "nato") -> str:
    """``words`` NATO words ("alpha bravo ..."), or with ``alphabet="digits"`` a number of ``words`` digits
    (the classic single-key passkey test, e.g. "71432")."""
    if alphabet == "digits":
        return str(int(rng.integers(1, 10))) + "".join(str(d) for d in rng.integers(0, 10, size=words - 1))
    if alphabet != "nato":
        raise ValueError(f"alphabet must be one of {', '.join(ALPHABETS)}, got {alphabet!r}")
    return " ".join(NATO[i] for i in rng.integers(0, len(NATO), size=words))


def passkey_correct(generated: str, answer: str) -> bool:
    """Whether ``generated`` starts with the passkey ``answer`` (case, spacing and punctuation ignored)."""
    want = re.findall(r"[a-z0-9]+", answer.lower())
    got = re.findall(r"[a-z0-9]+", generated.lower())
    return got[: len(want)] == want


def answer_prompt(sample: dict[str, Any], k: int = 0) -> torch.Tensor:
    """The ids to generate answer ``k`` from: the sample up to where that answer starts."""
    return sample["input_ids"][: int(sample["answer_spans"][k][0])]


def _prompt_pieces(tokenizer, hay: list[int], depths: list[float], passkeys: list[str], chat: bool,
                   stop_after_answers: bool) -> list[Piece]:
    n = len(passkeys)
    keys = [encode(tokenizer, " " + p) for p in passkeys]
    dot = text_piece(tokenizer, ".")
    book = [text_piece(tokenizer, _intro(n))]
    last = 0
    for k, d in enumerate(depths):
        cut = round(d * len(hay))
        book += [Piece(tuple(hay[last:cut])), text_piece(tokenizer, needle_text(k, n)), Piece(keys[k]), dot,
                 text_piece(tokenizer, "\n\n")]
        last = cut
    book += [Piece(tuple(hay[last:])), text_piece(tokenizer, BOOK_END)]
    if not chat:
        pieces = list(book)
        for k in range(n):
            pieces += [text_piece(tokenizer, f"{question_text(k, n)}\n{answer_lead(k, n)}"), Piece(keys[k], True)]
            if not (stop_after_answers and k == n - 1):
                pieces += [dot, text_piece(tokenizer, "\n\n")]
        return tk.plain_pieces(tokenizer, pieces)
    turns: list[tuple[str, list[Piece]]] = []
    for k in range(n):
        asked = text_piece(tokenizer, question_text(k, n))
        turns.append(("user", [*book, asked] if k == 0 else [asked]))
        turns.append(("assistant", [text_piece(tokenizer, answer_lead(k, n)), Piece(keys[k], True), dot]))
    pieces = tk.chat_pieces(tokenizer, turns)
    if stop_after_answers:  # cut the template's tail after the last answer
        last_label = max(i for i, p in enumerate(pieces) if p.label)
        pieces = pieces[: last_label + 1]
    return pieces


@dataclass(frozen=True)
class PasskeySettings:
    """Everything that determines a passkey dataset besides the tokenizer and the corpus text."""

    source: str = "pg-essays"
    lengths: tuple[int, int] = (1000, 10000)
    num_samples: int = 64
    num_passkeys: int = 10
    passkey_words: int = 32
    seed: int = 0
    split: str = "train"
    chat_template: bool = False
    depth_range: tuple[float, float] = (0.05, 0.95)
    pool_tokens: int = POOL_TOKENS
    alphabet: str = "nato"

    def __post_init__(self):
        if len(self.lengths) != 2:
            raise ValueError(f"lengths must be (low, high) in tokens, got {self.lengths}")
        lo, hi = self.lengths
        if not 1 <= lo <= hi:
            raise ValueError(f"lengths must be (low, high) with 1 <= low <= high tokens, got {self.lengths}")
        if not 1 <= self.num_passkeys <= len(ORDINALS):
            raise ValueError(f"num_passkeys must be 1..{len(ORDINALS)} (ordinals are spelled out), got {self.num_passkeys}")
        if self.passkey_words < 1 or self.num_samples < 1:
            raise ValueError(f"passkey_words and num_samples must be positive, got {self.passkey_words}, {self.num_samples}")
        d0, d1 = self.depth_range
        if not 0.0 <= d0 <= d1 <= 1.0:
            raise ValueError(f"depth_range must satisfy 0 <= low <= high <= 1, got {self.depth_range}")
        if self.alphabet not in ALPHABETS:
            raise ValueError(f"alphabet must be one of {', '.join(ALPHABETS)}, got {self.alphabet!r}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")


def spread_lengths(lo: int, hi: int, n: int, rng: np.random.Generator) -> list[int]:
    """``n`` lengths in [lo, hi], one uniform draw from each of n equal strata, in random order."""
    edges = np.linspace(lo, hi + 1, n + 1)
    draws = np.floor(edges[:-1] + rng.random(n) * (edges[1:] - edges[:-1])).astype(int)
    return [int(x) for x in rng.permutation(np.clip(draws, lo, hi))]


def _passkey_sample(tokenizer, hay: Haystack, s: PasskeySettings, length: int, rng: np.random.Generator):
    depths = sorted(float(x) for x in rng.uniform(*s.depth_range, size=s.num_passkeys))
    passkeys = [make_passkey(rng, s.passkey_words, s.alphabet) for _ in range(s.num_passkeys)]
    pieces = _prompt_pieces(tokenizer, hay.cut(length, rng), depths, passkeys, s.chat_template, False)
    input_ids, labels, spans = tk.assemble(pieces)
    return {"input_ids": input_ids, "labels": labels, "context_length": length,
            "depths": torch.tensor(depths, dtype=torch.float32), "answers": passkeys,
            "answer_spans": torch.tensor(spans, dtype=torch.long)}


def build_passkey_dataset(tokenizer, source: str | Corpus = "pg-essays", lengths: tuple[int, int] = (1000, 10000),
                          num_samples: int = 64, num_passkeys: int = 10, passkey_words: int = 32, seed: int = 0,
                          *, split: str = "train", chat_template: bool = False,
                          depth_range: tuple[float, float] = (0.05, 0.95), pool_tokens: int = POOL_TOKENS,
                          alphabet: str = "nato", cache: bool = True) -> tk.TokenDataset:
    """Multi-passkey retrieval prompts (see the module doc). Samples are dicts with ``input_ids`` and ``labels``
    (1-D LongTensors), ``context_length`` (haystack tokens), ``depths`` [num_passkeys], ``answers`` (the
    passkey strings) and ``answer_spans`` [num_passkeys, 2] (token ``[start, end)`` of each answer).
    ``split="eval"`` gives a held-out set: other haystack cuts, depths, lengths and passkeys for the same seed."""
    corpus = load_corpus(source)
    s = PasskeySettings(corpus.spec, tuple(lengths), num_samples, num_passkeys, passkey_words, seed, split,
                        bool(chat_template), tuple(depth_range), pool_tokens, alphabet)
    key = {**asdict(s), "tokenizer": tk.tokenizer_fingerprint(tokenizer), "corpus": corpus.fingerprint()}

    def build() -> list[dict[str, Any]]:
        hay = load_haystack(tokenizer, corpus, pool_tokens, use_cache=cache)
        hay.check_length(s.lengths[1])
        plan = np.random.default_rng([seed, SPLITS[split]])
        sizes = spread_lengths(*s.lengths, num_samples, plan)
        return [_passkey_sample(tokenizer, hay, s, n, np.random.default_rng([seed, SPLITS[split], 1 + i]))
                for i, n in enumerate(tqdm(sizes, desc="passkey prompts", leave=False))]

    return tk.cached("passkey", key, build, use_cache=cache)


def build_niah_dataset(tokenizer, source: str | Corpus = "pg-essays", lengths=(1000, 2000, 4000, 8000),
                       depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples_per_cell: int = 1, passkey_words: int = 32,
                       seed: int = 0, *, chat_template: bool = False, pool_tokens: int = POOL_TOKENS,
                       alphabet: str = "nato", cache: bool = True) -> tk.TokenDataset:
    """Single-passkey needle-in-a-haystack grid. Each sample: ``input_ids`` = prompt + answer, ``labels`` on
    the answer, ``prompt_length`` (= ``context_length``, the cell's length: generate from
    ``input_ids[:prompt_length]``), ``depth`` (0 = start of the haystack, 1 = end), ``answer`` (score with
    :func:`passkey_correct`)."""
    lengths, depths = tuple(int(n) for n in lengths), tuple(float(d) for d in depths)
    if not lengths or not depths or samples_per_cell < 1:
        raise ValueError("build_niah_dataset needs at least one length, one depth and samples_per_cell >= 1")
    if alphabet not in ALPHABETS:
        raise ValueError(f"alphabet must be one of {', '.join(ALPHABETS)}, got {alphabet!r}")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must lie in [0, 1], got {depths}")
    corpus = load_corpus(source)
    key = {"source": corpus.spec, "lengths": lengths, "depths": depths, "per_cell": samples_per_cell,
           "words": passkey_words, "alphabet": alphabet, "seed": seed, "chat": bool(chat_template), "pool": pool_tokens,
           "tokenizer": tk.tokenizer_fingerprint(tokenizer), "corpus": corpus.fingerprint()}
    def build() -> list[dict[str, Any]]:
        hay = load_haystack(tokenizer, corpus, pool_tokens, use_cache=cache)
        hay.check_length(max(lengths))
        cells = [(n, d, r) for n in lengths for d in depths for r in range(samples_per_cell)]
        samples = []
        with tqdm(cells, desc="needle grid", leave=False) as bar:  # closed (and cleared) by a refusal too
            for i, (n, d, _) in enumerate(bar):
                rng = np.random.default_rng([seed, 2, 1 + i])
                passkey = make_passkey(rng, passkey_words, alphabet)
                room = n - _overhead(tokenizer, passkey, chat_template)
                if room < 1:
                    raise ValueError(f"length {n} leaves no room for a haystack: the prompt around it takes "
                                     f"{n - room} tokens; use longer lengths or fewer passkey_words")
                pieces = _prompt_pieces(tokenizer, hay.cut(room, rng), [d], [passkey], bool(chat_template), True)
                input_ids, labels, spans = tk.assemble(pieces)
                samples.append({"input_ids": input_ids, "labels": labels, "prompt_length": spans[0][0],
                                "context_length": n, "depth": d, "answer": passkey,
                                "answer_spans": torch.tensor(spans, dtype=torch.long)})
        return samples

    return tk.cached("niah", key, build, use_cache=cache)


def _overhead(tokenizer, passkey: str, chat: bool) -> int:
    """Prompt tokens around an empty haystack for this passkey (its length enters the prompt via the needle)."""
    pieces = _prompt_pieces(tokenizer, [], [0.0], [passkey], bool(chat), True)
    return tk.assemble(pieces)[2][0][0]
