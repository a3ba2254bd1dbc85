"""LongBench: the metrics against hand-worked examples, reading the published layout, the truncation and the
offline message."""

import json
import zipfile

import pytest

from rolecall.data import longbench as lb
from tests.tiny import tiny_tokenizer


def test_qa_f1_normalises_and_counts_overlapping_tokens():
    assert lb.qa_f1("The Eiffel Tower!", "eiffel tower") == 1.0  # case, punctuation, articles
    # prediction "paris france" vs reference "paris": precision 1/2, recall 1, F1 2/3
    assert lb.qa_f1("Paris, France", "Paris") == pytest.approx(2 / 3)
    assert lb.qa_f1("London", "Paris") == 0.0 and lb.qa_f1("", "Paris") == 0.0
    assert lb.qa_f1("a a b", "a b b") == pytest.approx(2 / 3)  # overlap counts multiplicity: 2 of 3 each


def test_rouge_l_is_the_f1_of_the_longest_common_subsequence():
    # LCS of "the cat sat on the mat" and "the cat lay on a mat" is "the cat on mat" (4 of 6, 4 of 6)
    assert lb.rouge_l("the cat sat on the mat", "the cat lay on a mat") == pytest.approx(4 / 6)
    assert lb.rouge_l("a b c d", "d c b a") == pytest.approx(1 / 4)
    assert lb.rouge_l("x", "y") == 0.0 and lb.rouge_l("", "y") == 0.0


def test_classification_retrieval_count_and_code():
    classes = ["Location", "Number", "Other Location"]
    assert lb.classification("Location", "Location", classes) == 1.0
    assert lb.classification("Number or Location", "Location", classes) == 0.5
    assert lb.classification("Number", "Location", classes) == 0.0
    # "Location" is part of the reference "Other Location": found inside it, it does not split the credit
    assert lb.classification("Other Location", "Other Location", classes) == 1.0
    assert lb.classification("Other Location", "Location", classes) == 0.5  # both named, the right one among them
    assert lb.retrieval("Paragraph 12", "Paragraph 12") == 1.0
    assert lb.retrieval("Paragraph 12 or 3", "Paragraph 12") == 0.5 and lb.retrieval("none", "Paragraph 1") == 0.0
    assert lb.count("There are 7 paragraphs", "7") == 1.0 and lb.count("8, not 7", "7") == 0.5
    assert lb.code_sim("# comment\nx = 1\n", "x = 1") == 1.0
    assert 0 < lb.code_sim("x = 2", "x = 1") < 1


def test_score_takes_the_best_answer_and_the_first_line_where_longbench_does():
    assert lb.score("hotpotqa", "Paris", ["London", "Paris"]) == 1.0
    assert lb.score("triviaqa", "Paris\nQuestion: next one", ["Paris"]) == 1.0  # the first line only
    assert lb.score("hotpotqa", "Paris\nmore words", ["Paris"]) < 1.0
    assert lb.score("trec", "Location", ["Location"], ["Location", "Number"]) == 1.0


def _record(i, task):
    return json.dumps({"input": f"question {i}", "context": f"context number {i} " * 20, "answers": [f"a{i}"],
                       "length": 40, "dataset": task, "language": "en", "all_classes": None, "_id": str(i)})


def test_reads_a_folder_or_the_published_zip_in_file_order(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for task in ("hotpotqa", "trec"):
        (folder / f"{task}.jsonl").write_text("\n".join(_record(i, task) for i in range(5)) + "\n")
    with zipfile.ZipFile(tmp_path / "data.zip", "w") as z:  # the published zip keeps its files in data/
        for task in ("hotpotqa", "trec"):
            z.write(folder / f"{task}.jsonl", f"data/{task}.jsonl")
    from_folder = lb.load_tasks(["hotpotqa", "trec"], folder, limit=3)
    assert [(s["task"], s["input"]) for s in from_folder] == [
        ("hotpotqa", "question 0"), ("hotpotqa", "question 1"), ("hotpotqa", "question 2"),
        ("trec", "question 0"), ("trec", "question 1"), ("trec", "question 2")]
    assert lb.load_tasks(["hotpotqa", "trec"], tmp_path / "data.zip", limit=3) == from_folder
    with pytest.raises(lb.DataNotFound, match="neither a folder nor a zip file"):
        lb.load_tasks(["hotpotqa"], folder / "hotpotqa.jsonl")
    with pytest.raises(lb.DataNotFound, match="no musique.jsonl there"):
        lb.load_tasks(["musique"], folder)
    with pytest.raises(ValueError, match="unknown LongBench task.*nosuch.*choose from"):
        lb.load_tasks(["nosuch"], folder)
    (folder / "qasper.jsonl").write_text('{"context": "x"}\n')
    with pytest.raises(ValueError, match="qasper.jsonl line 1: not a LongBench record"):
        lb.load_tasks(["qasper"], folder)


def test_a_long_prompt_keeps_its_first_and_last_halves():
    tok = tiny_tokenizer()
    sample = {"task": "hotpotqa", "context": "word " * 400, "input": "which word?"}
    whole = tok(lb.TASKS["hotpotqa"].instruction.format(context=sample["context"], input=sample["input"]))["input_ids"]
    assert len(whole) > 101
    cut = lb.prompt_ids(tok, sample, 101)
    assert cut == whole[:50] + whole[-51:]
    assert lb.prompt_ids(tok, sample, len(whole) + 5) == whole


def test_offline_without_data_says_what_to_pass_in_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(lb.DataNotFound) as err:
        lb.load_tasks(["hotpotqa"])
    message = str(err.value)
    assert "\n" not in message and "THUDM/LongBench" in message and "--data PATH" in message
