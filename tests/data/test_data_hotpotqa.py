"""HotpotQA distractor prompts from fixture files in both layouts; closed-book filtering."""

import json

import pandas as pd
import pytest

from rolecall.data.corpora import CorpusError, CorpusNotFoundError
from rolecall.data.hotpotqa import (
    answered,
    build_hotpotqa_dataset,
    closed_book_answers,
    drop_answerable,
    load_hotpotqa,
    normalize_answer,
)
from tests.tiny import tiny_model, tiny_tokenizer


def _items(n=3):
    out = []
    for i in range(n):
        titles = [f"Title {i}-{k}" for k in range(4)]
        sentences = [[f"Fact {i}.{k}.0 is here.", f" Fact {i}.{k}.1 follows."] for k in range(4)]
        out.append({"id": f"q{i}", "question": f"Which fact is number {i}?" + " Really?" * i, "answer": f"Fact {i}",
                    "titles": titles, "sentences": sentences})
    return out


@pytest.fixture
def original_json(tmp_path):
    """The layout of the released hotpot_dev_distractor_v1.json: a JSON list, context as [title, sentences]."""
    path = tmp_path / "hotpot_dev_distractor_v1.json"
    rows = [{"_id": r["id"], "question": r["question"], "answer": r["answer"],
             "context": [[t, s] for t, s in zip(r["titles"], r["sentences"])]} for r in _items()]
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture
def hub_parquet(tmp_path):
    """The Hub layout: context as {"title": [...], "sentences": [[...]]}."""
    path = tmp_path / "hotpot.parquet"
    rows = [{"id": r["id"], "question": r["question"], "answer": r["answer"], "type": "bridge",
             "context": {"title": r["titles"], "sentences": r["sentences"]}} for r in _items()]
    pd.DataFrame(rows).to_parquet(path)
    return path


def test_both_layouts_give_the_same_items(original_json, hub_parquet, cache_dir):
    a, b = load_hotpotqa(str(original_json)), load_hotpotqa(str(hub_parquet))
    assert a == b and len(a) == 3
    assert a[1].paragraphs[2] == ("Title 1-2", "Fact 1.2.0 is here. Fact 1.2.1 follows.")
    assert [i.id for i in load_hotpotqa(str(hub_parquet), limit=2)] == ["q0", "q1"]


def test_prompt_holds_every_passage_in_order_then_question_then_labelled_answer(original_json, cache_dir):
    tok = tiny_tokenizer()
    ds = build_hotpotqa_dataset(tok, str(original_json))
    assert len(ds) == 3
    for s, item in zip(ds, load_hotpotqa(str(original_json))):
        text = tok.decode(s["input_ids"])
        where = [text.index(f"Passage {k + 1}: {t}\n{p}") for k, (t, p) in enumerate(item.paragraphs)]
        assert where == sorted(where)
        assert text.index(f"Question: {item.question}\nAnswer:") > where[-1]
        n = s["prompt_length"]
        assert tok.decode(s["input_ids"][n:]) == " " + item.answer
        assert tok.decode(s["labels"][n:]) == " " + item.answer and bool((s["labels"][:n] == -100).all())
    chat = build_hotpotqa_dataset(tok, str(original_json), chat_template=True)
    text = tok.decode(chat[0]["input_ids"])
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\nFact 0")
    assert tok.decode(chat[0]["labels"][chat[0]["prompt_length"]:]) == "Fact 0"
    short = build_hotpotqa_dataset(tok, str(original_json), max_length=len(ds[1]["input_ids"]))  # longer questions
    assert [s["id"] for s in short] == ["q0", "q1"]


def test_max_length_that_drops_everything_and_bad_sources_fail_clearly(original_json, tmp_path, cache_dir):
    tok = tiny_tokenizer()
    with pytest.raises(CorpusError, match="no prompt fits"):
        build_hotpotqa_dataset(tok, str(original_json), max_length=10)
    with pytest.raises(CorpusNotFoundError, match="does not exist"):
        load_hotpotqa(str(tmp_path / "missing.json"))
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "x"}\n')
    with pytest.raises(CorpusError, match="lacks the fields answer, context, question"):
        load_hotpotqa(str(other))


def test_answer_matching_and_closed_book_filter(original_json, cache_dir):
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert answered("It was the Fact 1, surely", "fact 1") and not answered("Fact 12", "Fact 1")
    tok = tiny_tokenizer()
    ds = build_hotpotqa_dataset(tok, str(original_json))
    # a closed-book "model" that knows question 1 only
    kept = drop_answerable(ds, lambda qs: ["fact 1." if "number 1" in q else "no idea" for q in qs])
    assert [s["id"] for s in kept] == ["q0", "q2"] and kept.info["closed_book_filtered"] == 1
    with pytest.raises(ValueError, match="returned 1 answers for 3"):
        drop_answerable(ds, lambda qs: ["x"])


def test_closed_book_answers_run_a_model_greedily():
    tok, model = tiny_tokenizer(), tiny_model()
    got = closed_book_answers(model, tok, ["Who?", "Where?"], max_new_tokens=3)
    assert len(got) == 2 and all(isinstance(g, str) for g in got)
    assert got == closed_book_answers(model, tok, ["Who?", "Where?"], max_new_tokens=3)  # greedy: repeatable
    assert len(closed_book_answers(model, tok, ["Who?"], max_new_tokens=3, chat_template=True)) == 1
