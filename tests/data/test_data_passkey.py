"""Passkey prompts: structure, depths, labels, lengths, determinism, cache and the needle grid.

Most tests use the byte-level tiny tokenizer (one token per byte) on an ASCII corpus written by the test, so
token positions can be read off the decoded text.
"""

import re

import numpy as np
import pytest
import torch

from rolecall.data.corpora import CorpusError
from rolecall.data.passkey import (
    NATO,
    answer_prompt,
    build_niah_dataset,
    build_passkey_dataset,
    needle_text,
    passkey_correct,
    question_text,
    spread_lengths,
)
from rolecall.data.tokens import cache_root
from tests.tiny import tiny_tokenizer

WORDS = ("river", "stone", "lantern", "orchard", "meadow", "harbour", "quiet", "morning", "copper", "window")


@pytest.fixture
def corpus(tmp_path):
    """Three ASCII documents of ~6K characters each, no NATO words, no digits."""
    rng = np.random.default_rng(7)
    folder = tmp_path / "books"
    folder.mkdir()
    for i in range(3):
        words = [WORDS[j] for j in rng.integers(0, len(WORDS), size=1000)]
        (folder / f"book{i}.txt").write_text(" ".join(words) + ".")
    return f"text:{folder}"


@pytest.fixture
def tok():
    return tiny_tokenizer()


def _build(tok, corpus, **kw):
    args = dict(source=corpus, lengths=(1500, 3000), num_samples=3, num_passkeys=4, passkey_words=6, seed=0)
    args.update(kw)
    return build_passkey_dataset(tok, **args)


def test_labels_cover_exactly_the_answers_and_needles_sit_at_their_depths(tok, corpus, cache_dir):
    ds = _build(tok, corpus)
    assert len(ds) == 3
    for s in ds:
        ids, labels, spans = s["input_ids"], s["labels"], s["answer_spans"]
        assert ids.dtype == labels.dtype == torch.long and ids.shape == labels.shape
        # labels: the answer spans exactly, equal to the input there; -100 elsewhere
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for (a, b), answer in zip(spans.tolist(), s["answers"]):
            mask[a:b] = True
            assert tok.decode(ids[a:b]) == " " + answer
        assert torch.equal(labels[mask], ids[mask]) and bool((labels[~mask] == -100).all())
        assert len(s["answers"]) == 4 and all(len(a.split()) == 6 and set(a.split()) <= set(NATO) for a in s["answers"])

        text = tok.decode(ids)
        book_start = text.index("<book>\n") + len("<book>\n")
        book_end = text.index("\n</book>")
        book, hay_before = text[book_start:book_end], 0
        cursor = 0
        for k, (depth, answer) in enumerate(zip(s["depths"].tolist(), s["answers"])):
            needle = f"{needle_text(k, 4)} {answer}.\n\n"
            at = book.index(needle, cursor)
            hay_before += at - cursor  # haystack characters (= tokens) before this needle
            assert hay_before == round(depth * s["context_length"])
            cursor = at + len(needle)
        assert hay_before + len(book) - cursor == s["context_length"]  # all the haystack, nothing more
        assert all(0.05 <= d <= 0.95 for d in s["depths"].tolist())
        assert s["depths"].tolist() == sorted(s["depths"].tolist())
        # questions in order after the book, each answered
        tail = text[book_end:]
        positions = [tail.index(f"{question_text(k, 4)}\nThe {o} passkey is: {a}.")
                     for k, (o, a) in enumerate(zip(("first", "second", "third", "fourth"), s["answers"]))]
        assert positions == sorted(positions)


def test_lengths_are_spread_over_the_range(tok, corpus, cache_dir):
    rng = np.random.default_rng(0)
    got = sorted(spread_lengths(1000, 8999, 8, rng))
    assert [g // 1000 for g in got] == list(range(1, 9))  # one per 1000-token stratum
    ds = _build(tok, corpus, lengths=(1200, 4200), num_samples=3)
    assert sorted(s["context_length"] // 1000 for s in ds) == [1, 2, 3]


def test_same_seed_same_samples_other_seed_or_split_differs(tok, corpus, cache_dir):
    a = _build(tok, corpus, cache=False)
    b = _build(tok, corpus, cache=False)
    c = _build(tok, corpus, seed=1, cache=False)
    e = _build(tok, corpus, split="eval", cache=False)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    for other in (c, e):
        assert all(not torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, other))
        assert {x["context_length"] for x in a} != {y["context_length"] for y in other}


def test_cache_hit_returns_the_same_and_settings_change_the_key(tok, corpus, cache_dir):
    a = _build(tok, corpus)
    files = sorted(p.name for p in cache_root().glob("passkey-*.pt"))
    assert len(files) == 1 and a.info["key"] + ".pt" == files[0]
    b = _build(tok, corpus)
    assert all(torch.equal(x["labels"], y["labels"]) for x, y in zip(a, b))
    c = _build(tok, corpus, passkey_words=5)
    assert c.info["key"] != a.info["key"] and len(list(cache_root().glob("passkey-*.pt"))) == 2


def test_chat_template_keeps_labels_on_the_answers(tok, corpus, cache_dir):
    s = _build(tok, corpus, chat_template=True, num_samples=1)[0]
    text = tok.decode(s["input_ids"])
    assert text.count("<|im_start|>assistant\n") == 4 and text.count("<|im_start|>user\n") == 4
    labelled = s["labels"][s["labels"] != -100]
    assert tok.decode(labelled) == "".join(" " + a for a in s["answers"])
    assert all(f"passkey is: {a}.<|im_end|>" in text for a in s["answers"])


def test_bad_settings_and_short_corpus_fail_with_one_line(tok, corpus, tmp_path, cache_dir):
    with pytest.raises(ValueError, match="lengths"):
        _build(tok, corpus, lengths=(3000, 1000))
    with pytest.raises(ValueError, match="lengths must be"):
        _build(tok, corpus, lengths=(1000, 2000, 3000))
    with pytest.raises(ValueError, match="num_passkeys"):
        _build(tok, corpus, num_passkeys=21)
    with pytest.raises(CorpusError, match="fewer than the 50,000-token haystack"):
        _build(tok, corpus, lengths=(1000, 50_000))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("   \n")
    with pytest.raises(CorpusError, match="empty"):
        _build(tok, f"text:{tmp_path / 'empty'}")


def test_needle_grid_cells_have_their_length_depth_and_answer(tok, corpus, cache_dir):
    ds = build_niah_dataset(tok, corpus, lengths=(600, 1500), depths=(0.0, 0.5, 1.0), samples_per_cell=2,
                            passkey_words=5)
    assert len(ds) == 2 * 3 * 2
    cells = sorted((s["context_length"], s["depth"]) for s in ds)
    assert cells == sorted([(n, d) for n in (600, 1500) for d in (0.0, 0.5, 1.0)] * 2)
    for s in ds:
        assert s["prompt_length"] == s["context_length"]
        assert len(s["input_ids"]) == s["prompt_length"] + len(s["answer"]) + 1  # " " + answer, one byte a token
        assert tok.decode(s["labels"][s["prompt_length"]:]) == " " + s["answer"]
        assert bool((s["labels"][: s["prompt_length"]] == -100).all())
        assert torch.equal(answer_prompt(s), s["input_ids"][: s["prompt_length"]])
        text = tok.decode(s["input_ids"])
        needle = f"{needle_text(0, 1)} {s['answer']}.\n\n"
        book = text[text.index("<book>\n") + 7: text.index("\n</book>")]
        hay = len(book) - len(needle)
        assert book.index(needle) == round(s["depth"] * hay)
    with pytest.raises(ValueError, match="no room"):
        build_niah_dataset(tok, corpus, lengths=(100,), depths=(0.5,), passkey_words=5)


def test_passkey_correct_ignores_case_and_punctuation_but_not_words():
    assert passkey_correct(" Alpha bravo, charlie. And more", "alpha bravo charlie")
    assert not passkey_correct("alpha charlie bravo", "alpha bravo charlie")
    assert not passkey_correct("alpha bravo", "alpha bravo charlie")


@pytest.mark.slow
def test_embedded_tokenizer_4k_sample_holds_ten_needles_in_order():
    from rolecall.core.models import load_tokenizer

    tok = load_tokenizer()
    ds = build_passkey_dataset(tok, lengths=(4000, 4000), num_samples=1, cache=False)
    s = ds[0]
    assert s["context_length"] == 4000
    text = tok.decode(s["input_ids"])
    ordinals = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
    where = [text.index(f"Remember this: the {o} passkey is: {a}.") for o, a in zip(ordinals, s["answers"])]
    assert where == sorted(where) and len(set(s["answers"])) == 10
    assert all(len(a.split()) == 32 for a in s["answers"])
    got = [tok.decode(s["labels"][a:b]) for a, b in s["answer_spans"].tolist()]
    assert got == [" " + a for a in s["answers"]]
    assert int((s["labels"] != -100).sum()) == sum(b - a for a, b in s["answer_spans"].tolist())
    assert re.search(r"What is the tenth passkey\?\nThe tenth passkey is:", text)
    again = build_passkey_dataset(tok, lengths=(4000, 4000), num_samples=1, cache=False)[0]
    other = build_passkey_dataset(tok, lengths=(4000, 4000), num_samples=1, seed=1, cache=False)[0]
    assert torch.equal(again["input_ids"], s["input_ids"]) and not torch.equal(other["input_ids"], s["input_ids"])


class _Oracle:
    """Predicts the true next token everywhere except at the positions in ``wrong``."""

    def __init__(self, vocab, wrong=()):
        self.vocab, self.wrong = vocab, set(wrong)

    def __call__(self, input_ids, logits_to_keep):
        nxt = input_ids[0, logits_to_keep + 1].clone()
        for i, p in enumerate(logits_to_keep.tolist()):
            if p in self.wrong:
                nxt[i] = (nxt[i] + 1) % self.vocab
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float().unsqueeze(0)
        return type("Out", (), {"logits": logits})()


def test_teacher_forced_scoring_counts_exact_answers(tok, corpus, cache_dir):
    from rolecall.data.check_retrieval import answer_hits

    s = _build(tok, corpus, num_samples=1)[0]
    vocab = len(tok)
    hits, acc, first = answer_hits(_Oracle(vocab), s)
    assert hits == [True] * 4 and acc == 1.0 and first == [True] * 4
    a, b = s["answer_spans"][1].tolist()
    hits, acc, first = answer_hits(_Oracle(vocab, wrong={b - 2}), s)  # second answer's last token wrong
    n = sum(e - st for st, e in s["answer_spans"].tolist())
    assert hits == [True, False, True, True] and first == [True] * 4 and acc == pytest.approx(1 - 1 / n)
    hits, _, first = answer_hits(_Oracle(vocab, wrong={a - 1}), s)  # second answer's first token wrong
    assert hits == [True, False, True, True] and first == [True, False, True, True]


def test_digit_passkeys(tok, corpus, cache_dir):
    s = _build(tok, corpus, num_samples=1, passkey_words=5, alphabet="digits")[0]
    assert all(re.fullmatch(r"[1-9]\d{4}", a) for a in s["answers"])
    assert [tok.decode(s["labels"][a:b]) for a, b in s["answer_spans"].tolist()] == [" " + a for a in s["answers"]]
    assert passkey_correct(" 71432. It was", "71432") and not passkey_correct("714325", "71432")
    with pytest.raises(ValueError, match="alphabet must be one of nato, digits"):
        _build(tok, corpus, alphabet="greek")
