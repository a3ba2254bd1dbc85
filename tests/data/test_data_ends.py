"""The data builders' sizes, cuts and scores at their exact ends, worked by hand: stratified lengths when every
stratum holds one length, a haystack cut as long as the haystack, needles at depth 0, 1 and a half-token
(Python's round: halves go to the even index), noise filler that is a whole number of sentences and one token
more, the largest list that fits a room exactly, a long prompt cut to an odd or even length, labelled spans at
the first and last token, the passkey's first answer token and a one-word passkey, whole-word answers, and
line numbers that count blank lines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rolecall.data import builders, passkey, ruler
from rolecall.data import longbench as lb
from rolecall.data import tokens as tk
from rolecall.data.corpora import CorpusError
from rolecall.data.haystack import Haystack
from rolecall.data.hotpotqa import answered
from rolecall.data.jsonl import iter_jsonl
from rolecall.data.tokens import Piece


class _Tok:
    """A tokenizer whose ids are fixed by the test: ``bare`` without special tokens, ``special`` with them."""

    def __init__(self, bare, special=None):
        self.bare, self.special = list(bare), list(special if special is not None else bare)

    def encode(self, text, add_special_tokens=True):
        return list(self.special if add_special_tokens else self.bare)


# -- lengths and cuts --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lo, hi", [(5, 5), (1, 4), (10, 19), (1000, 1015)])
def test_one_length_per_stratum_covers_the_range_exactly(lo, hi):
    """n = hi − lo + 1 strata over [lo, hi + 1) are one integer wide, so the lengths are lo … hi, hi included,
    each once."""
    for seed in range(3):
        got = passkey.spread_lengths(lo, hi, hi - lo + 1, np.random.default_rng(seed))
        assert sorted(got) == list(range(lo, hi + 1))


@pytest.mark.parametrize("lo, hi, n, strata", [
    (1, 4, 2, [{1, 2}, {3, 4}]),  # [1, 3) and [3, 5)
    (1, 6, 3, [{1, 2}, {3, 4}, {5, 6}]),
    (7, 7, 3, [{7}, {7}, {7}]),  # one length: every draw is it
])
def test_each_stratum_gives_one_length(lo, hi, n, strata):
    for seed in range(10):
        got = sorted(passkey.spread_lengths(lo, hi, n, np.random.default_rng(seed)))
        assert all(x in s for x, s in zip(got, strata)), got


@pytest.mark.parametrize("size, length, ok", [(5, 5, True), (5, 6, False), (5, 1, True), (1, 1, True), (5, 0, True)])
def test_a_haystack_cut_may_take_every_token(size, length, ok):
    hay = Haystack(torch.arange(size, dtype=torch.int32), "test", "f")
    if not ok:
        with pytest.raises(CorpusError, match=f"holds {size} tokens of this tokenizer, fewer than the {length}-token"):
            hay.cut(length, np.random.default_rng(0))
        return
    for seed in range(5):
        got = hay.cut(length, np.random.default_rng(seed))
        assert len(got) == length and got == list(range(got[0], got[0] + length)) if length else got == []
    if length == size:
        assert hay.cut(length, np.random.default_rng(1)) == list(range(size))


# -- needles, filler and lists -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("depths, cuts", [
    ([0.0], [0]), ([1.0], [10]), ([0.5], [5]),
    ([0.25], [2]),  # 2.5 tokens → 2 (half to even)
    ([0.75], [8]),  # 7.5 → 8
    ([0.14], [1]), ([0.16], [2]),
    ([0.9, 0.1], [1, 9]),  # placed in order of depth
    ([0.0, 1.0], [0, 10]),
])
def test_needles_are_inserted_at_the_rounded_depth(depths, cuts):
    """Filler of 10 tokens 0..9; a needle at depth d sits after the first round(10 d) filler tokens."""
    needles = [(d, Piece((100 + i,))) for i, d in enumerate(depths)]
    flat = [t for p in ruler._insert(list(range(10)), needles) for t in p.ids]
    assert [t for t in flat if t < 100] == list(range(10))
    placed = sorted((flat.index(100 + i), d) for i, d in enumerate(depths))
    assert [at - k for k, (at, _) in enumerate(placed)] == cuts


@pytest.mark.parametrize("tokens, filler", [
    (0, []), (-2, []), (1, [7]), (3, [7, 8, 9]), (6, [7, 8, 9, 7, 8, 9]), (7, [7, 8, 9, 7, 8, 9, 7]),
])
def test_noise_filler_is_whole_sentences_cut_to_the_token(tokens, filler):
    """The noise sentences are 3 tokens (7, 8, 9) here: a filler of a whole number of sentences ends on one."""
    c = ruler.Context(_Tok([7, 8, 9]), None, np.random.default_rng(0), room=100, depth=0.5)
    assert c.filler("noise", tokens) == filler


@pytest.mark.parametrize("room, hi, per, n", [
    (5, 10, 1, 5), (10, 10, 1, 10), (11, 10, 1, 10), (9, 10, 1, 9), (0, 10, 1, 0), (5, 0, 1, 0),
    (6, 10, 2, 2),  # make(n) is 2n + 1 tokens: 5 fit in 6, 7 do not
    (7, 10, 2, 3),  # 7 tokens fit exactly
    (1, 10, 2, 0),
])
def test_the_largest_fitting_list_fills_the_room_exactly(room, hi, per, n):
    def make(k):
        return [Piece(tuple(range(per * k + (per - 1))))]

    got, pieces = ruler._largest_fitting(make, room, hi)
    assert got == n and len(pieces[0].ids) == per * n + per - 1


@pytest.mark.parametrize("generated, answers, share", [
    ("x 123 y", ["123"], 1.0), ("X ABC", ["abc", "def"], 0.5), ("nothing", ["a1", "b2"], 0.0),
    ("a1 b2 c3", ["a1", "b2", "c3"], 1.0), ("x abc", ["ABC", "q"], 0.5),  # case ignored on both sides
])
def test_ruler_score_is_the_share_of_answers_found(generated, answers, share):
    assert ruler.score(generated, answers) == share


def test_ruler_score_needs_an_answer():
    with pytest.raises(ValueError, match="at least one"):
        ruler.score("x", [])


# -- LongBench prompts and scores --------------------------------------------------------------------------------------
@pytest.mark.parametrize("length, ids", [
    (10, list(range(10))), (11, list(range(10))),  # fits: the whole prompt
    (9, [0, 1, 2, 3, 5, 6, 7, 8, 9]),  # odd: the first 4 and the last 5
    (8, [0, 1, 2, 3, 6, 7, 8, 9]),  # even: 4 and 4
    (2, [0, 9]), (1, [9]),  # one token: the last
])
def test_a_long_prompt_keeps_its_first_and_last_halves(length, ids):
    tok = lambda text: {"input_ids": list(range(10))}  # noqa: E731
    sample = {"task": next(iter(lb.TASKS)), "context": "c", "input": "i"}
    assert lb.prompt_ids(tok, sample, length) == ids


@pytest.mark.parametrize("task, prediction, reference, value", [
    ("passage_count", "3", "3", 1.0), ("passage_count", "3 4 3", "3", 2 / 3), ("passage_count", "none", "3", 0.0),
    ("passage_count", "33", "3", 0.0),  # whole numbers only
    ("passage_retrieval_en", "Paragraph 3", "Paragraph 3", 1.0),
    ("passage_retrieval_en", "Paragraph 3 or Paragraph 12", "Paragraph 12", 0.5),
    ("passage_retrieval_en", "Paragraph 3", "no paragraph", 0.0),
    ("passage_retrieval_en", "Paragraph 2", "Paragraph 2 (not Paragraph 5)", 1.0),  # the reference's first number
])
def test_number_scores_are_the_share_of_numbers_that_match(task, prediction, reference, value):
    assert lb.score(task, prediction, [reference]) == pytest.approx(value)


# -- tokens and samples ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pieces, labels, spans", [
    ([Piece((1, 2), True)], [1, 2], [(0, 2)]),  # a labelled piece at the first token
    ([Piece((1,)), Piece((2, 3), True)], [-100, 2, 3], [(1, 3)]),  # ... and at the last
    ([Piece((1,)), Piece((), True), Piece((2,))], [-100, -100], [(1, 1)]),  # an empty labelled piece: an empty span
    ([Piece((1,), True), Piece((2,), True)], [1, 2], [(0, 1), (1, 2)]),  # adjacent spans touch, [start, end)
    ([], [], []),
])
def test_assemble_spans_are_half_open(pieces, labels, spans):
    ids, got_labels, got_spans = tk.assemble(pieces)
    assert got_labels.tolist() == labels and got_spans == spans
    assert ids.tolist() == [t for p in pieces for t in p.ids]


@pytest.mark.parametrize("lengths", [[1], [3], [2, 2], [1, 3], [3, 1, 2]])
def test_pad_collate_pads_to_the_longest_sample(lengths):
    samples = [{"input_ids": torch.arange(1, n + 1), "labels": torch.arange(1, n + 1), "n": n} for n in lengths]
    batch = tk.pad_collate(samples, pad_id=0)
    width = max(lengths)
    for row, n in enumerate(lengths):
        assert batch["input_ids"][row].tolist() == list(range(1, n + 1)) + [0] * (width - n)
        assert batch["labels"][row].tolist() == list(range(1, n + 1)) + [-100] * (width - n)
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
    assert batch["n"] == lengths


@pytest.mark.parametrize("special, bare, prefix", [
    ([1, 50], [50], (1,)), ([50, 2], [50], ()), ([50], [50], ()), ([1, 7, 50, 51], [50, 51], (1, 7)),
    ([1, 50, 2], [50], (1,)), ([1, 2], [50], ()),  # the bare ids nowhere: no prefix known
])
def test_prefix_ids_are_what_comes_before_the_text(special, bare, prefix):
    assert tk.prefix_ids(_Tok(bare, special)) == prefix


@pytest.mark.parametrize("lines, read", [
    (["{}"], [(1, {})]),
    (["", "{}", "  ", "[1]"], [(2, {}), (4, [1])]),  # blank lines are skipped but counted
    (["", ""], []),
])
def test_jsonl_line_numbers_count_blank_lines(tmp_path, lines, read):
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert list(iter_jsonl(path, ValueError, "{}")) == read


def test_a_bad_jsonl_line_is_named_by_its_number(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("{}\n\nnot json\n")
    with pytest.raises(ValueError, match="line 3 is not JSON"):
        list(iter_jsonl(path, ValueError, "{}"))


@pytest.mark.parametrize("names, ok", [(["a"], True), (["a", "b"], True), ([], False), (["a", "z"], False)])
def test_check_names_needs_at_least_one_known_name(names, ok):
    if ok:
        assert builders.check_names("thing", names, ("a", "b")) == tuple(names)
    else:
        with pytest.raises(ValueError, match=f"unknown thing\\(s\\) {'z' if names else '.none given.'}; choose from: a, b"):
            builders.check_names("thing", names, ("a", "b"))


# -- passkeys ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("generated, answer, correct", [
    ("alpha bravo", "alpha bravo", True), ("Alpha, BRAVO! charlie", "alpha bravo", True),
    ("alpha", "alpha bravo", False), ("bravo alpha", "alpha bravo", False), ("x alpha bravo", "alpha bravo", False),
    ("71432", "71432", True), ("7143", "71432", False), ("714320", "71432", False), ("71432.", "71432", True),
])
def test_passkey_correct_means_the_answer_words_first(generated, answer, correct):
    assert passkey.passkey_correct(generated, answer) is correct


@pytest.mark.parametrize("words", [1, 2, 5])
def test_a_digit_passkey_has_words_digits_and_no_leading_zero(words):
    for seed in range(100):  # 100 first digits: a zero among them would show up
        key = passkey.make_passkey(np.random.default_rng(seed), words, "digits")
        assert len(key) == words and key.isdigit() and key[0] != "0"


@pytest.mark.parametrize("words", [1, 3])
def test_a_nato_passkey_has_words_words(words):
    key = passkey.make_passkey(np.random.default_rng(0), words)
    assert len(key.split()) == words and all(w in passkey.NATO for w in key.split())


@pytest.mark.parametrize("k, count, question", [
    (0, 1, "What is the passkey?"), (0, 2, "What is the first passkey?"), (1, 2, "What is the second passkey?"),
    (19, 20, "What is the twentieth passkey?"),
])
def test_passkeys_are_named_by_ordinal_from_two_on(k, count, question):
    assert passkey.question_text(k, count) == question
    assert passkey.answer_lead(k, count) == question[8].upper() + question[9:-1] + " is:"


@pytest.mark.parametrize("settings, ok", [
    ({"lengths": (1, 1)}, True), ({"lengths": (0, 1)}, False), ({"lengths": (5, 4)}, False),
    ({"num_passkeys": 20}, True), ({"num_passkeys": 21}, False), ({"num_passkeys": 1}, True),
    ({"num_passkeys": 0}, False), ({"depth_range": (0.0, 0.0)}, True), ({"depth_range": (1.0, 1.0)}, True),
    ({"depth_range": (0.6, 0.5)}, False), ({"depth_range": (-0.01, 0.5)}, False), ({"depth_range": (0.5, 1.01)}, False),
    ({"passkey_words": 1, "num_samples": 1}, True), ({"passkey_words": 0}, False), ({"num_samples": 0}, False),
])
def test_passkey_settings_at_their_range_ends(settings, ok):
    if ok:
        passkey.PasskeySettings(**settings)
    else:
        with pytest.raises(ValueError):
            passkey.PasskeySettings(**settings)


# -- answers -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prediction, answer, hit", [
    ("Paris", "paris", True), ("in Paris.", "paris", True), ("Parisian", "paris", False), ("New York City", "york", True),
    ("York", "new york", False), ("the", "The", False), ("a b", "a", False), ("", "paris", False),
])
def test_answered_means_whole_words_after_normalisation(prediction, answer, hit):
    """An answer that normalises to nothing (only articles) is never found."""
    assert answered(prediction, answer) is hit


# -- reasoning problems ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source, limit, names", [
    ("arithmetic:1", None, ["arithmetic-0"]),
    ("arithmetic:3", None, ["arithmetic-0", "arithmetic-1", "arithmetic-2"]),
    ("arithmetic:5", 5, [f"arithmetic-{i}" for i in range(5)]),  # a limit of exactly all of them
    ("arithmetic:5", 6, [f"arithmetic-{i}" for i in range(5)]),  # ... or more
    ("arithmetic:5", 1, ["arithmetic-0"]),
    ("arithmetic", None, [f"arithmetic-{i}" for i in range(32)]),  # no count: 32
])
def test_problem_counts_and_limits_at_their_ends(source, limit, names):
    from rolecall.data.reasoning import load_problems

    assert [p.name for p in load_problems(source, limit)] == names


@pytest.mark.parametrize("source, limit, says", [
    ("arithmetic:0", None, "at least one problem"), ("arithmetic:-1", None, "at least one problem"),
    ("arithmetic:x", None, "the argument is the number of problems"), ("arithmetic:3", 0, "limit must be positive"),
])
def test_problem_counts_below_one_are_refused(source, limit, says):
    from rolecall.data.reasoning import load_problems

    with pytest.raises(ValueError, match=says):
        load_problems(source, limit)
