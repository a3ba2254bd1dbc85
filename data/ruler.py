"""A RULER-style synthetic long-context suite, generated offline for any tokenizer and any length.

The task families of RULER (Hsieh et al. 2024), written anew here:

===========================  ==================================================================================
task                         what the prompt holds and asks
===========================  ==================================================================================
``niah_single_noise``        one "secret number" needle in repeated filler sentences
``niah_single_essay``        one number needle in essay text (the shipped haystack corpus)
``niah_single_uuid``         one UUID needle in essay text
``niah_multikey``            four needles under different keys in essay text; one key asked for
``niah_multikey_dense``      the whole context is needles (word keys, numbers); one key asked for
``niah_multikey_uuid``       the whole context is needles with UUID keys and UUID values; one asked for
``niah_multivalue``          four numbers under the same key; all four asked for
``niah_multiquery``          four keys; all four asked for at once
``variable_tracking``        a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... hidden in filler; every
                             variable holding the value asked for
``common_words``             a numbered word list: ten words appear many times, the rest a few; the ten
                             most common asked for
``frequent_words``           a stream of coded words drawn from a Zipf law; the three most frequent asked for
===========================  ==================================================================================

Every sample records its task, family, target length (the whole prompt in tokens of this tokenizer), the
depth of the asked needle (None where a task has none), the expected strings and a generation budget. A
sample is a function of the seed, the task, the length and its index: the same on every machine. Scoring is
RULER's: the share of the expected strings found in the generation (:func:`score`), so a wrong answer scores
0 and a complete one 1.

Prompts are plain text after the tokenizer's BOS, or with ``chat_template=True`` a user turn (the task) and
the start of an assistant turn (the answer's lead words), so generation continues the answer.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rolecall.data import tokens as tk
from rolecall.data.corpora import load_corpus
from rolecall.data.haystack import POOL_TOKENS, Haystack, load_haystack
from rolecall.data.tokens import Piece, encode, text_piece

NOISE = "The river runs to the sea. The hills stand still. The day goes by and comes again. "
ADJECTIVES = ("amber", "bold", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lucky", "misty", "noble", "odd", "plain", "quiet", "rapid", "silent", "tidy", "upper", "vivid",
              "warm", "young", "zesty", "brisk", "crisp", "deep", "early", "fierce")
NOUNS = ("anchor", "badger", "candle", "desert", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "rocket", "saddle", "temple",
         "umbrella", "valley", "walnut", "yarrow", "zephyr", "bridge", "castle", "dragon", "feather", "glacier")
KEY_PAIRS = len(ADJECTIVES) * len(NOUNS)  # distinct adjective-noun keys
DEPTHS = tuple(i / 10 for i in range(11))  # where the asked needle sits, cycled over a cell's samples


@dataclass(frozen=True)
class Task:
    family: str  # niah, variable_tracking, common_words, frequent_words
    max_new_tokens: int  # generation budget (RULER's: 128 for needles, 30, 120 and 50)
    build: Callable[..., tuple[list[Piece], str, str, list[str], float | None]]


def score(generated: str, answers: list[str]) -> float:
    """RULER's string match: the share of ``answers`` found in ``generated`` (case ignored)."""
    if not answers:
        raise ValueError("score needs at least one expected string")
    text = generated.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


# -- needles --------------------------------------------------------------------------------------------------
def _key(rng: np.random.Generator) -> str:
    return f"{ADJECTIVES[rng.integers(len(ADJECTIVES))]}-{NOUNS[rng.integers(len(NOUNS))]}"


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _uuid(rng: np.random.Generator) -> str:
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))


def _needle(key: str, value: str, kind: str) -> str:
    return f"\nThe secret {kind} for {key} is {value}.\n"


def _distinct(make: Callable[[], str], count: int, taken: set[str] | None = None) -> list[str]:
    taken = set() if taken is None else taken
    out: list[str] = []
    while len(out) < count:
        v = make()
        if v not in taken:
            taken.add(v)
            out.append(v)
    return out


def _insert(filler: list[int], needles: list[tuple[float, Piece]]) -> list[Piece]:
    """Filler token ids with needle pieces inserted at their depths (fractions of the filler)."""
    out: list[Piece] = []
    last = 0
    for depth, piece in sorted(needles, key=lambda x: x[0]):
        cut = round(depth * len(filler))
        out += [Piece(tuple(filler[last:cut])), piece]
        last = cut
    return [*out, Piece(tuple(filler[last:]))]


class Context:
    """What a task builder needs: the tokenizer, the essay haystack, the room its filler may take, a rng."""

    def __init__(self, tokenizer, hay: Haystack | None, rng: np.random.Generator, room: int, depth: float):
        self.tok, self.hay, self.rng, self.room, self.depth = tokenizer, hay, rng, room, depth
        self._noise = encode(tokenizer, NOISE)

    def piece(self, text: str) -> Piece:
        return text_piece(self.tok, text)

    def filler(self, kind: str, tokens: int) -> list[int]:
        """``tokens`` ids of essay text (a random cut) or of the repeated noise sentences."""
        tokens = max(tokens, 0)
        if kind == "essay":
            return self.hay.cut(tokens, self.rng) if tokens else []
        reps = -(-tokens // max(len(self._noise), 1))
        return list(self._noise * reps)[:tokens]

    def fill_with(self, pieces: list[Piece], kind: str, needles: list[tuple[float, Piece]]) -> list[Piece]:
        """Filler of ``kind`` around ``needles``, sized so the whole context takes ``room`` tokens."""
        used = sum(len(p.ids) for _, p in needles) + sum(len(p.ids) for p in pieces)
        return pieces + _insert(self.filler(kind, self.room - used), needles)


def _single(kind: str, value_kind: str):
    def build(c: Context):
        key = _key(c.rng)
        value = _uuid(c.rng) if value_kind == "uuid" else _number(c.rng)
        label = "UUID" if value_kind == "uuid" else "number"
        needle = c.piece(_needle(key, value, label))
        return (c.fill_with([], kind, [(c.depth, needle)]), f"What is the secret {label} for {key}?",
                f"The secret {label} for {key} is", [value], c.depth)

    return build


def _multikey(c: Context):
    keys = _distinct(lambda: _key(c.rng), 4)
    values = _distinct(lambda: _number(c.rng), 4)
    depths = [c.depth] + [float(d) for d in c.rng.uniform(0, 1, 3)]
    needles = [(d, c.piece(_needle(k, v, "number"))) for d, k, v in zip(depths, keys, values)]
    return (c.fill_with([], "essay", needles), f"What is the secret number for {keys[0]}?",
            f"The secret number for {keys[0]} is", [values[0]], c.depth)


def _dense(key_kind: str):
    def build(c: Context):
        taken: set[str] = set()

        def word_key() -> str:  # past the adjective-noun pairs (a context of ~900 needles), a numbered pair
            return _key(c.rng) if len(taken) < KEY_PAIRS else f"{_key(c.rng)}-{int(c.rng.integers(2, 1000))}"

        make_key = (lambda: _uuid(c.rng)) if key_kind == "uuid" else word_key
        make_value = (lambda: _uuid(c.rng)) if key_kind == "uuid" else (lambda: _number(c.rng))
        label = "UUID" if key_kind == "uuid" else "number"
        asked_key, asked_value = make_key(), make_value()
        asked = c.piece(_needle(asked_key, asked_value, label))
        lines: list[Piece] = []
        used = len(asked.ids)
        taken.add(asked_key)
        while True:  # distractor needles until the room is full
            line = c.piece(_needle(_distinct(make_key, 1, taken)[0], make_value(), label))
            if used + len(line.ids) > c.room:
                break
            lines.append(line)
            used += len(line.ids)
        at = round(c.depth * len(lines))
        body = [*lines[:at], asked, *lines[at:], Piece(tuple(c.filler("noise", c.room - used)))]
        return body, f"What is the secret {label} for {asked_key}?", f"The secret {label} for {asked_key} is", \
            [asked_value], c.depth

    return build


def _multivalue(c: Context):
    key = _key(c.rng)
    values = _distinct(lambda: _number(c.rng), 4)
    depths = [c.depth] + [float(d) for d in c.rng.uniform(0, 1, 3)]
    needles = [(d, c.piece(_needle(key, v, "number"))) for d, v in zip(depths, values)]
    return (c.fill_with([], "essay", needles), f"What are all the secret numbers for {key}?",
            f"The secret numbers for {key} are", values, c.depth)


def _multiquery(c: Context):
    keys = _distinct(lambda: _key(c.rng), 4)
    values = _distinct(lambda: _number(c.rng), 4)
    depths = [c.depth] + [float(d) for d in c.rng.uniform(0, 1, 3)]
    needles = [(d, c.piece(_needle(k, v, "number"))) for d, k, v in zip(depths, keys, values)]
    asked = ", ".join(keys[:-1]) + f" and {keys[-1]}"
    return (c.fill_with([], "essay", needles), f"What are the secret numbers for {asked}?",
            f"The secret numbers for {asked} are", values, c.depth)


def _variable_tracking(c: Context, hops: int = 4):
    names = _distinct(lambda: "".join(chr(65 + int(i)) for i in c.rng.integers(0, 26, 5)), hops + 1)
    value = str(int(c.rng.integers(10_000, 100_000)))
    lines = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    depths = np.linspace(0.05, 0.95, len(lines))  # in order, spread through the filler
    needles = [(float(d), c.piece(f"\n{line}\n")) for d, line in zip(depths, lines)]
    return (c.fill_with([], "noise", needles), f"Which variables hold the value {value}? Name all of them.",
            f"The variables that hold {value} are", names, None)


@functools.cache
def _corpus_words(spec: str) -> tuple[str, ...]:
    """The distinct lowercase words of 4-10 letters in a corpus, sorted."""
    return tuple(sorted({w for d in load_corpus(spec) for w in re.findall(r"\b[a-z]{4,10}\b", d.text)}))


def _words(c: Context) -> list[str]:
    """The essay corpus's words in a random order of this sample."""
    seen = _corpus_words(c.hay.corpus)
    return [seen[i] for i in c.rng.permutation(len(seen))]


def _largest_fitting(make: Callable[[int], list[Piece]], room: int, hi: int) -> tuple[int, list[Piece]]:
    """The largest ``n`` in [0, hi] whose pieces ``make(n)`` fit ``room`` tokens (they grow with n), and those
    pieces."""
    lo, best = 0, make(0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        pieces = make(mid)
        if sum(len(p.ids) for p in pieces) <= room:
            lo, best = mid, pieces
        else:
            hi = mid - 1
    return lo, best


def _common_words(c: Context, common: int = 10):
    vocab = _words(c)
    if len(vocab) < common + 50:
        raise ValueError(f"corpus {c.hay.corpus!r} has only {len(vocab)} distinct words; common_words needs more")
    top, rest = vocab[:common], vocab[common:]
    tokens_per_word = max(1, round(np.mean([len(encode(c.tok, f" {i}. {w}")) for i, w in enumerate(top, 1)])))
    freq = int(np.clip(c.room // (3 * common * tokens_per_word), 2, 30))  # common words: half the list or less
    seed = int(c.rng.integers(2**31))

    def make(n: int) -> list[Piece]:
        items = top * freq + rest[:n] * max(1, freq // 10)
        order = np.random.default_rng(seed).permutation(len(items))
        return [c.piece(" " + " ".join(f"{i}. {items[j]}" for i, j in enumerate(order, 1)))]

    _, body = _largest_fitting(make, c.room, len(rest))
    return (body, f"What are the {common} most common words in the list above?",
            f"The {common} most common words in the list are", top, None)


def _frequent_words(c: Context, vocab_size: int = 2000, alpha: float = 2.0, asked: int = 3):
    vocab = _distinct(lambda: "".join(chr(97 + int(i)) for i in c.rng.integers(0, 26, 5)), vocab_size)
    weights = 1.0 / np.arange(1, vocab_size + 1) ** alpha
    draws = c.rng.choice(vocab_size, size=max(c.room, 16), p=weights / weights.sum())

    def make(n: int) -> list[Piece]:
        return [c.piece(" " + " ".join(vocab[i] for i in draws[:n]))]

    n, body = _largest_fitting(make, c.room, len(draws))
    counts = np.bincount(draws[:n], minlength=vocab_size)
    top = [vocab[i] for i in np.argsort(-counts, kind="stable")[:asked]]
    return (body, f"What are the {asked} most frequent coded words in the text above?",
            f"The {asked} most frequent coded words are", top, None)


TASKS: dict[str, Task] = {
    "niah_single_noise": Task("niah", 128, _single("noise", "number")),
    "niah_single_essay": Task("niah", 128, _single("essay", "number")),
    "niah_single_uuid": Task("niah", 128, _single("essay", "uuid")),
    "niah_multikey": Task("niah", 128, _multikey),
    "niah_multikey_dense": Task("niah", 128, _dense("word")),
    "niah_multikey_uuid": Task("niah", 128, _dense("uuid")),
    "niah_multivalue": Task("niah", 128, _multivalue),
    "niah_multiquery": Task("niah", 128, _multiquery),
    "variable_tracking": Task("variable_tracking", 30, _variable_tracking),
    "common_words": Task("common_words", 120, _common_words),
    "frequent_words": Task("frequent_words", 50, _frequent_words),
}


# -- prompts --------------------------------------------------------------------------------------------------
INTRO = "Read the text below carefully; a question about it follows.\n\n<text>\n"
OUTRO = "\n</text>\n\n"


def _prompt(tokenizer, body: list[Piece], question: str, lead: str, answers: list[str], chat: bool) -> list[Piece]:
    """The whole sample: intro, body, question, the answer's lead words and (labelled) the expected answer."""
    answer = Piece(tuple(encode(tokenizer, " " + ", ".join(answers) + ".")), True)
    task = [text_piece(tokenizer, INTRO), *body, text_piece(tokenizer, OUTRO + question)]
    if not chat:
        return tk.plain_pieces(tokenizer, [*task, text_piece(tokenizer, "\n" + lead), answer])
    pieces = tk.chat_pieces(tokenizer, [("user", task), ("assistant", [text_piece(tokenizer, lead), answer])])
    return pieces[: max(i for i, p in enumerate(pieces) if p.label) + 1]


def _sample(tokenizer, hay: Haystack | None, task: str, length: int, index: int, seed: int, chat: bool) -> dict:
    spec = TASKS[task]
    depth = DEPTHS[index % len(DEPTHS)]
    rng_seed = [seed, list(TASKS).index(task), length, index]
    probe = spec.build(Context(tokenizer, hay, np.random.default_rng(rng_seed), 0, depth))
    overhead = sum(len(p.ids) for p in _prompt(tokenizer, probe[0], *probe[1:4], chat) if not p.label)
    overhead -= sum(len(p.ids) for p in probe[0])  # the prompt around the body, for this task's wording
    room = length - overhead
    if room < 16:
        raise ValueError(f"length {length} leaves {room} tokens for the {task} text; use lengths of at least "
                         f"{overhead + 16}")
    body, question, lead, answers, depth = spec.build(Context(tokenizer, hay, np.random.default_rng(rng_seed),
                                                              room, depth))
    input_ids, labels, spans = tk.assemble(_prompt(tokenizer, body, question, lead, answers, chat))
    return {"input_ids": input_ids, "labels": labels, "prompt_length": spans[0][0], "context_length": length,
            "task": task, "family": spec.family, "depth": depth, "answers": answers,
            "max_new_tokens": spec.max_new_tokens}


def check_tasks(tasks) -> tuple[str, ...]:
    from rolecall.data import check_names

    return check_names("RULER task", tasks, TASKS)


PARALLEL_FROM = 256  # samples from which the suite is built in worker processes (each sample is independent)


def build_workers(samples: int) -> int:
    """Worker processes for a suite of ``samples`` samples: one per CPU core up to 16 from
    :data:`PARALLEL_FROM` samples (a 32K-token list task re-tokenizes its list a dozen times; a GPU machine's
    cores build the 4,400 samples of a four-length grid in a fraction of the serial time), else none."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(16, cores) if samples >= PARALLEL_FROM and cores > 2 else 1


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer, hay: Haystack, seed: int, chat: bool) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    torch.set_num_threads(1)
    _WORKER.update(tokenizer=tokenizer, hay=hay, seed=seed, chat=chat)


def _worker_sample(cell: tuple[str, int, int]) -> dict:
    w = _WORKER
    return _sample(w["tokenizer"], w["hay"], *cell, w["seed"], w["chat"])


def _build_samples(tokenizer, hay: Haystack, cells: list[tuple[str, int, int]], seed: int, chat: bool,
                   workers: int) -> list[dict[str, Any]]:
    """Every cell's sample, in order; with ``workers`` > 1 in that many fresh processes. Each sample depends only
    on its own seed, so the output is the same bytes for any number of workers."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    bar = dict(total=len(cells), desc="RULER prompts", leave=False)
    if workers > 1 and not multiprocessing.current_process().daemon:  # a daemon process may not start others
        try:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_init_worker, initargs=(tokenizer, hay, seed, chat)) as pool, \
                    tqdm(pool.map(_worker_sample, cells, chunksize=4), **bar) as done:  # cleared by a refusal too
                return list(done)
        except BrokenProcessPool as e:  # a worker died (memory, a signal): the same samples, serially
            print(f"RULER prompts: worker processes failed ({e}); building serially", file=sys.stderr)
    with tqdm(cells, **bar) as todo:
        return [_sample(tokenizer, hay, t, n, i, seed, chat) for t, n, i in todo]


def build_ruler_dataset(tokenizer, tasks=tuple(TASKS), lengths=(4096,), samples_per_cell: int = 10, seed: int = 0,
                        *, source: str = "pg-essays", chat_template: bool = False, pool_tokens: int = POOL_TOKENS,
                        cache: bool = True, workers: int | None = None) -> tk.TokenDataset:
    """``samples_per_cell`` samples per (task, length). Each: ``input_ids`` = prompt + expected answer,
    ``prompt_length`` (generate from ``input_ids[:prompt_length]``, at most ``context_length`` tokens),
    ``task``, ``family``, ``depth``, ``answers`` (score with :func:`score`) and ``max_new_tokens``.
    ``workers``: processes that build the samples (default :func:`build_workers`); the same output for any."""
    tasks, lengths = check_tasks(tasks), tuple(int(n) for n in lengths)
    if not lengths or min(lengths) < 1 or samples_per_cell < 1:
        raise ValueError("build_ruler_dataset needs positive lengths and samples_per_cell >= 1")
    corpus = load_corpus(source)
    key = {"tasks": tasks, "lengths": lengths, "per_cell": samples_per_cell, "seed": seed, "source": corpus.spec,
           "chat": bool(chat_template), "pool": pool_tokens, "tokenizer": tk.tokenizer_fingerprint(tokenizer),
           "corpus": corpus.fingerprint(), "version": 1}

    def build() -> list[dict[str, Any]]:
        hay = load_haystack(tokenizer, corpus, pool_tokens, use_cache=cache)
        hay.check_length(max(lengths))
        cells = [(t, n, i) for t in tasks for n in lengths for i in range(samples_per_cell)]
        return _build_samples(tokenizer, hay, cells, seed, bool(chat_template),
                              build_workers(len(cells)) if workers is None else workers)

    return tk.cached("ruler", key, build, use_cache=cache)


def prompt_ids(sample: dict[str, Any]) -> torch.Tensor:
    """The ids to generate the answer from."""
    return sample["input_ids"][: int(sample["prompt_length"])]
