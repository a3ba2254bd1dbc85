"""Reasoning prompts: CHAMP from its package, user JSONL, the arithmetic generator, chat formatting."""

import json
import re

import pytest
import torch

from rolecall.data.corpora import CorpusError, CorpusNotFoundError
from rolecall.data.reasoning import (
    INSTRUCTION,
    build_reasoning_dataset,
    format_prompt,
    load_problems,
    load_prompts,
)
from tests.tiny import tiny_tokenizer


def test_champ_has_270_problems_with_answers(cache_dir):
    problems = load_problems("champ")
    assert len(problems) == 270 and len({p.name for p in problems}) == 270
    assert all(p.prompt.strip() and p.answer for p in problems)
    first = next(p for p in problems if p.name == "P_Combinatorics_1")
    assert first.answer == "239" and "length 6" in first.prompt
    prompts = load_prompts()
    assert len(prompts) == 270 and all(p.endswith(INSTRUCTION) for p in prompts)
    assert load_prompts("champ", limit=3, instruction=None) == [p.prompt for p in problems[:3]]


def test_jsonl_prompts_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2+2?", "answer": 4}) + "\n\n" + json.dumps({"prompt": "Hi"}) + "\n")
    problems = load_problems(f"jsonl:{path}")
    assert [(p.prompt, p.answer) for p in problems] == [("What is 2+2?", "4"), ("Hi", None)]
    assert load_prompts(str(path), instruction=None) == ["What is 2+2?", "Hi"]  # a bare .jsonl path works too
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(CorpusError, match="line 1 has no non-empty string field 'prompt'"):
        load_prompts(f"jsonl:{bad}")
    with pytest.raises(CorpusNotFoundError, match="no such file"):
        load_prompts(f"jsonl:{tmp_path / 'missing.jsonl'}")
    with pytest.raises(CorpusError, match="unknown reasoning source"):
        load_prompts("gsm8k")


def _solve(text: str) -> int:
    """An independent solver for the three shapes, reading the numbers back from the text."""
    n = [int(x) for x in re.findall(r"\d+", text)]
    if "buys" in text:
        return n[0] + n[1] * n[2] - n[3]
    if "train" in text:
        return n[0] * n[1] + n[2] * n[3]
    return n[0] // n[1] // n[2]


def test_arithmetic_answers_are_right_and_repeatable():
    problems = load_problems("arithmetic:30")
    assert len(problems) == 30 and problems == load_problems("arithmetic:30")
    assert {p.prompt.split(".")[0].split()[1] for p in problems} >= {"train"}  # all shapes appear
    for p in problems:
        assert int(p.answer) == _solve(p.prompt) and int(p.answer) >= 0
    assert len(load_problems("arithmetic")) == 32
    with pytest.raises(CorpusError, match="number of problems"):
        load_problems("arithmetic:many")


def test_format_prompt_uses_the_chat_template_when_there_is_one():
    tok = tiny_tokenizer()
    assert format_prompt(tok, "Solve x.") == "<|im_start|>user\nSolve x.<|im_end|>\n<|im_start|>assistant\n"
    assert format_prompt(tok, "Solve x.", system="Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSolve x.<|im_end|>\n<|im_start|>assistant\n")
    tok.chat_template = None
    assert format_prompt(tok, "Solve x.") == "Solve x.\n"


def test_reasoning_dataset_tokenises_the_formatted_prompts(cache_dir):
    tok = tiny_tokenizer()
    ds = build_reasoning_dataset(tok, "arithmetic:4")
    assert len(ds) == 4
    for s, p in zip(ds, load_prompts("arithmetic:4")):
        assert tok.decode(s["input_ids"]) == format_prompt(tok, p)
        assert s["labels"].shape == s["input_ids"].shape and bool((s["labels"] == -100).all())
        assert int(s["answer"]) == _solve(s["prompt"])
    again = build_reasoning_dataset(tok, "arithmetic:4")
    assert again.info["key"] == ds.info["key"] and torch.equal(again[0]["input_ids"], ds[0]["input_ids"])
