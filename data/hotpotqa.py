"""HotpotQA in the distractor setting as long-context prompts: the question's ten paragraphs (two gold, eight
retrieved distractors) form the context, the answer's tokens are the only targets.

Read through ``datasets`` from a Hub id (default ``hotpotqa/hotpot_qa``, config ``distractor``) or a local
file: the original JSON list (``context = [[title, [sentences]], ...]``), or JSONL / parquet rows in the Hub
layout (``context = {"title": [...], "sentences": [[...]]}``). Questions that a model answers without the
context can be dropped (:func:`drop_answerable`, with :func:`closed_book_answers`), as the paper does, so
that what remains needs retrieval from the context.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from rolecall.data.corpora import CorpusError, CorpusNotFoundError, builder_for
from rolecall.data.tokens import (
    Piece,
    TokenDataset,
    assemble,
    cache_root,
    cached,
    chat_pieces,
    encode,
    plain_pieces,
    sha256_text,
    text_piece,
    tokenizer_fingerprint,
)

HUB_ID = "hotpotqa/hotpot_qa"
INSTRUCTION = "Answer the question using the passages below. Reply with the answer only."


@dataclass(frozen=True)
class HotpotItem:
    id: str
    question: str
    answer: str
    paragraphs: tuple[tuple[str, str], ...]  # (title, text) in the dataset's order

    def __post_init__(self):
        if not self.question.strip() or not self.answer.strip() or not self.paragraphs:
            raise CorpusError(f"HotpotQA row {self.id!r} lacks a question, an answer or context paragraphs")


def _paragraphs(context: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(context, dict):  # Hub layout
        pairs = zip(context["title"], context["sentences"])
    else:  # original layout
        pairs = ((title, sentences) for title, sentences in context)
    return tuple((str(t), "".join(s) if isinstance(s, list | tuple) else str(s)) for t, s in pairs)


def load_hotpotqa(source: str = HUB_ID, split: str = "validation", config: str = "distractor",
                  limit: int | None = None) -> list[HotpotItem]:
    """Rows of HotpotQA from a Hub id or a local file, as :class:`HotpotItem`; the first ``limit`` of them."""
    import datasets

    cache = str(cache_root() / "hf-datasets")
    path = Path(source).expanduser()
    try:
        if path.is_file():
            builder = builder_for(path)
            if builder is None:
                raise CorpusError(f"hotpotqa: cannot read {path.name}; use .json, .jsonl(.zst) or .parquet")
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache)
        elif path.suffix or source.startswith((".", "/", "~")):
            raise CorpusNotFoundError(f"hotpotqa: {path} does not exist; pass the path of a HotpotQA file "
                                      "(e.g. hotpot_dev_distractor_v1.json) or a Hub id")
        else:
            ds = datasets.load_dataset(source, config, split=split, cache_dir=cache)
    except (CorpusError, CorpusNotFoundError):
        raise
    except Exception as e:  # datasets raises many types for "not reachable" and "not a dataset"
        raise CorpusNotFoundError(f"hotpotqa: could not load {source!r} ({type(e).__name__}); without Hub access "
                                  "pass a local file such as hotpot_dev_distractor_v1.json") from None
    missing = {"question", "answer", "context"} - set(ds.column_names)
    if missing:
        raise CorpusError(f"hotpotqa: {source} lacks the fields {', '.join(sorted(missing))}; is it HotpotQA?")
    rows = ds if limit is None else ds.select(range(min(limit, len(ds))))
    return [HotpotItem(str(r.get("id") or r.get("_id") or i), r["question"], str(r["answer"]), _paragraphs(r["context"]))
            for i, r in enumerate(rows)]


def _pieces(tokenizer, item: HotpotItem, chat: bool) -> list[Piece]:
    passages = "".join(f"Passage {i + 1}: {title}\n{text.strip()}\n\n" for i, (title, text) in enumerate(item.paragraphs))
    body = f"{INSTRUCTION}\n\n{passages}Question: {item.question}"
    if not chat:
        return plain_pieces(tokenizer, [text_piece(tokenizer, f"{body}\nAnswer:"),
                                        Piece(encode(tokenizer, " " + item.answer), True)])
    pieces = chat_pieces(tokenizer, [("user", [text_piece(tokenizer, body)]),
                                     ("assistant", [Piece(encode(tokenizer, item.answer), True)])])
    last = max(i for i, p in enumerate(pieces) if p.label)
    return pieces[: last + 1]


def build_hotpotqa_dataset(tokenizer, source: str = HUB_ID, split: str = "validation", limit: int | None = None,
                           max_length: int | None = None, *, chat_template: bool = False,
                           cache: bool = True) -> TokenDataset:
    """Prompts of (instruction, ten passages, question) followed by the answer; labels on the answer only.
    Samples: ``input_ids``, ``labels``, ``prompt_length`` (= ``context_length``), ``answer``, ``question``,
    ``id``. Prompts longer than ``max_length`` tokens (answer included) are left out."""
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be positive or None, got {max_length}")
    items = load_hotpotqa(source, split, limit=limit)
    key = {"source": source, "split": split, "limit": limit, "max_length": max_length, "chat": bool(chat_template),
           "tokenizer": tokenizer_fingerprint(tokenizer),
           "content": sha256_text(repr([(i.id, i.question, i.answer, i.paragraphs) for i in items]))}

    def build() -> list[dict[str, Any]]:
        samples = []
        for item in tqdm(items, desc="hotpotqa prompts", leave=False):
            input_ids, labels, spans = assemble(_pieces(tokenizer, item, bool(chat_template)))
            if max_length is not None and len(input_ids) > max_length:
                continue
            samples.append({"input_ids": input_ids, "labels": labels, "prompt_length": spans[0][0],
                            "context_length": spans[0][0], "answer": item.answer, "question": item.question,
                            "id": item.id})
        if not samples:
            raise CorpusError(f"hotpotqa: no prompt fits in max_length={max_length} tokens; raise it")
        return samples

    return cached("hotpotqa", key, build, use_cache=cache)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the usual QA answer normalisation)."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def answered(prediction: str, answer: str) -> bool:
    """Whether ``prediction`` contains ``answer`` as whole words after normalisation."""
    p, a = normalize_answer(prediction), normalize_answer(answer)
    return bool(a) and re.search(rf"(^| ){re.escape(a)}( |$)", p) is not None


@torch.no_grad()
def closed_book_answers(model, tokenizer, questions: Sequence[str], max_new_tokens: int = 16,
                        chat_template: bool = False) -> list[str]:
    """Greedy answers of ``model`` to ``questions`` with no context at all."""
    out = []
    for q in tqdm(questions, desc="closed-book answers", leave=False):
        if chat_template:
            messages = [{"role": "user", "content": f"Question: {q}\nReply with the answer only."}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = list(encode(tokenizer, text))
        else:
            ids = list(assemble(plain_pieces(tokenizer, [text_piece(tokenizer, f"Question: {q}\nAnswer:")]))[0])
        prompt = torch.tensor([ids], dtype=torch.long, device=model.device)
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        out.append(tokenizer.decode(gen[0, prompt.shape[1]:], skip_special_tokens=True))
    return out


def drop_answerable(dataset: TokenDataset, answer_fn: Callable[[list[str]], list[str]]) -> TokenDataset:
    """The samples whose question ``answer_fn`` (questions → closed-book answers) does *not* answer."""
    predictions = answer_fn([s["question"] for s in dataset])
    if len(predictions) != len(dataset):
        raise ValueError(f"answer_fn returned {len(predictions)} answers for {len(dataset)} questions")
    keep = [i for i, (s, p) in enumerate(zip(dataset, predictions)) if not answered(p, s["answer"])]
    return dataset.subset(keep, closed_book_filtered=len(dataset) - len(keep))
