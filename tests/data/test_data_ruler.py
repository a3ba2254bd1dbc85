"""The RULER-style suite: every task's prompt holds what its answer needs, at the asked length and depth, the
same for a seed on every run, and the scorer gives RULER's string-match recall.

The byte-level tiny tokenizer (one token per byte) and an ASCII corpus written by the test make token
positions readable off the decoded text.
"""

import re
from collections import Counter

import numpy as np
import pytest
import torch

from rolecall.data.ruler import DEPTHS, TASKS, build_ruler_dataset, prompt_ids, score
from tests.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Four ASCII documents from 300 made-up words (no digits, no capitals)."""
    rng = np.random.default_rng(11)
    vocab = sorted({"".join(chr(97 + int(i)) for i in rng.integers(0, 26, int(rng.integers(4, 9)))) for _ in range(300)})
    folder = tmp_path_factory.mktemp("books")
    for i in range(4):
        words = [vocab[j] for j in rng.integers(0, len(vocab), size=3000)]
        (folder / f"book{i}.txt").write_text(" ".join(words) + ".")
    return f"text:{folder}"


@pytest.fixture(scope="module")
def suite(corpus):
    tok = tiny_tokenizer()
    return tok, build_ruler_dataset(tok, lengths=(600, 1500), samples_per_cell=3, source=corpus, cache=False)


def _text(tok, sample) -> str:
    return tok.decode(prompt_ids(sample))


def test_every_task_and_length_is_there_at_its_length(suite):
    tok, ds = suite
    cells = Counter((s["task"], s["context_length"]) for s in ds)
    assert set(cells) == {(t, n) for t in TASKS for n in (600, 1500)} and set(cells.values()) == {3}
    for s in ds:
        n = len(prompt_ids(s))
        if s["task"] in ("common_words", "frequent_words"):  # whole words only: at most one item short
            assert s["context_length"] - 20 <= n <= s["context_length"], (s["task"], n)
        else:
            assert n == s["context_length"], (s["task"], n)
        assert s["max_new_tokens"] == TASKS[s["task"]].max_new_tokens


def test_needles_hold_their_answers_at_their_depths(suite):
    tok, ds = suite
    for s in (s for s in ds if s["family"] == "niah"):
        text = _text(tok, s)
        asked = re.search(r"What (?:is|are)(?: all)? the secret (?:numbers?|UUID) for (.+)\?", text).group(1)
        keys = re.split(r", | and ", asked)
        for key, value in zip(keys * len(s["answers"]) if len(keys) == 1 else keys, s["answers"]):
            assert f"The secret number for {key} is {value}." in text or f"The secret UUID for {key} is {value}." in text
        if s["task"] in ("niah_single_noise", "niah_single_essay", "niah_single_uuid"):
            body_start, body_end = text.index("<text>\n") + 7, text.index("\n</text>")
            at = text.index(f" for {keys[0]} is ")
            assert abs((at - body_start) / (body_end - body_start) - s["depth"]) < 0.06, (s["task"], s["depth"])
    depths = [s["depth"] for s in ds if s["task"] == "niah_single_essay" and s["context_length"] == 600]
    assert depths == list(DEPTHS[:3])


def test_distractors_never_answer_the_question(suite):
    tok, ds = suite
    for s in (s for s in ds if s["task"] in ("niah_multikey", "niah_multikey_dense", "niah_multikey_uuid")):
        text = _text(tok, s)
        key = re.search(r"What is the secret (?:number|UUID) for (.+)\?", text).group(1)
        assert text.count(f" for {key} is ") == 1  # the one needle (the lead words end the prompt at "is")
        if s["task"] != "niah_multikey":  # a context made of needles
            body = text.split("<text>\n")[1].split("\n</text>")[0]
            needles = re.findall(r"\nThe secret (?:number|UUID) for \S+ is \S+\.\n", body)
            assert len(needles) >= 3 and sum(map(len, needles)) > 0.8 * len(body)


def test_variable_chain_resolves_to_the_answers(suite):
    tok, ds = suite
    for s in (s for s in ds if s["task"] == "variable_tracking"):
        text = _text(tok, s)
        value = re.search(r"hold the value (\d+)\?", text).group(1)
        held = set()
        for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", text):  # in order of appearance
            if rhs == value or rhs[4:] in held:
                held.add(name)
        assert held == set(s["answers"]) and len(held) == 5


def test_word_counts_rank_the_answers_first(suite):
    tok, ds = suite
    for s in (s for s in ds if s["family"] in ("common_words", "frequent_words")):
        body = _text(tok, s).split("<text>\n")[1].split("\n</text>")[0]
        words = re.findall(r"[a-z]+", body)
        counts = Counter(words).most_common()
        k = len(s["answers"])
        assert {w for w, _ in counts[:k]} == set(s["answers"]), s["task"]
        assert counts[k - 1][1] > counts[k][1]  # no tie at the cut


def test_same_seed_same_prompts_other_seed_others(corpus):
    tok = tiny_tokenizer()
    kw = dict(tasks=("niah_multiquery", "frequent_words"), lengths=(700,), samples_per_cell=2, source=corpus,
              cache=False)
    a, b = build_ruler_dataset(tok, **kw), build_ruler_dataset(tok, **kw)
    c = build_ruler_dataset(tok, seed=1, **kw)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    assert all(x["answers"] != z["answers"] for x, z in zip(a, c))


def test_chat_prompts_end_in_the_answer_lead(corpus):
    tok = tiny_tokenizer()
    ds = build_ruler_dataset(tok, tasks=("niah_single_essay",), lengths=(800,), samples_per_cell=1, source=corpus,
                             chat_template=True, cache=False)
    text = _text(tok, ds[0])
    assert text.startswith("<|im_start|>user") and text.endswith("The secret number for " + text.split(
        "What is the secret number for ")[1].split("?")[0] + " is")
    assert len(prompt_ids(ds[0])) == 800


def test_score_is_the_share_of_expected_strings_found():
    assert score("The secret number is 1234567.", ["1234567"]) == 1.0
    assert score("The secret number is 1234568.", ["1234567"]) == 0.0
    assert score("ALPHA and gamma", ["alpha", "beta", "gamma", "delta"]) == 0.5
    with pytest.raises(ValueError, match="at least one"):
        score("x", [])


def test_bad_requests_are_refused_in_one_line(corpus):
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="unknown RULER task.*niah_single_noise"):
        build_ruler_dataset(tok, tasks=("niah_single",), source=corpus, cache=False)
    with pytest.raises(ValueError, match="use lengths of at least"):
        build_ruler_dataset(tok, tasks=("niah_multiquery",), lengths=(120,), samples_per_cell=1, source=corpus,
                            cache=False)


def test_tokenising_bar_ends_complete_on_a_short_corpus(corpus, monkeypatch):
    """A corpus shorter than the token pool still ends its progress bar at its total."""
    import rolecall.data.haystack as haystack

    bars = []
    real = haystack.tqdm

    def spy(*args, **kwargs):
        bars.append(real(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(haystack, "tqdm", spy)
    hay = haystack.load_haystack(tiny_tokenizer(), corpus, use_cache=False)
    assert bars and bars[0].n == bars[0].total == len(hay) < haystack.POOL_TOKENS


def test_dense_keys_stay_distinct_past_the_adjective_noun_pairs(corpus):
    """A context long enough for more distractor needles than there are adjective-noun pairs (a 32K-token
    prompt of a real tokenizer holds about 2,000) is still built, every key once, the asked one among them."""
    from rolecall.data.ruler import KEY_PAIRS

    tok = tiny_tokenizer()
    (s,) = build_ruler_dataset(tok, tasks=("niah_multikey_dense",), lengths=(60_000,), samples_per_cell=1,
                               source=corpus, cache=False)
    keys = re.findall(r"\nThe secret number for (\S+) is \S+\.\n", _text(tok, s))
    assert len(keys) > KEY_PAIRS and len(set(keys)) == len(keys)


def test_worker_processes_build_the_same_samples(corpus):
    """Built in two worker processes, the suite is the same samples in the same order as built serially (each
    sample depends on its own seed only); small suites are built serially by default."""
    from rolecall.data.ruler import PARALLEL_FROM, build_workers

    tok = tiny_tokenizer()
    kw = dict(tasks=("niah_multikey", "common_words", "variable_tracking"), lengths=(500, 700), samples_per_cell=2,
              source=corpus, cache=False)
    serial, parallel = build_ruler_dataset(tok, workers=1, **kw), build_ruler_dataset(tok, workers=2, **kw)
    assert len(serial) == len(parallel) == 12
    for x, y in zip(serial, parallel):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
        assert (x["task"], x["answers"], x["depth"], x["prompt_length"]) == \
            (y["task"], y["answers"], y["depth"], y["prompt_length"])
    assert build_workers(PARALLEL_FROM - 1) == 1
