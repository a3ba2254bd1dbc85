"""Pieces, chat-template splicing, BOS handling, batching and the dataset cache."""

import pytest
import torch
from tokenizers.processors import TemplateProcessing

from rolecall.data import tokens as tk
from rolecall.data.tokens import IGNORE, Piece, encode
from tests.tiny import tiny_tokenizer


def test_assemble_labels_only_the_labelled_pieces():
    ids, labels, spans = tk.assemble([Piece((1, 2)), Piece((3, 4, 5), True), Piece((6,)), Piece((7,), True)])
    assert ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert labels.tolist() == [IGNORE, IGNORE, 3, 4, 5, IGNORE, 7]
    assert spans == [(2, 5), (6, 7)]


def test_chat_pieces_splice_turns_into_the_template_unchanged():
    tok = tiny_tokenizer()
    # ids that re-tokenising the text would never give back (a special token inside the user turn)
    odd = Piece((tok.convert_tokens_to_ids("<pad>"),) + encode(tok, "hay"))
    answer = Piece(encode(tok, "42"), True)
    pieces = tk.chat_pieces(tok, [("user", [odd]), ("assistant", [answer])])
    ids, labels, spans = tk.assemble(pieces)
    assert tok.decode(ids) == "<|im_start|>user\n<pad>hay<|im_end|>\n<|im_start|>assistant\n42<|im_end|>\n"
    assert tok.decode(ids[spans[0][0]:spans[0][1]]) == "42" and int((labels != IGNORE).sum()) == 2
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tk.chat_pieces(tok, [("user", [odd])])


def test_plain_prompts_get_the_bos_a_tokenizer_adds_and_not_its_eos():
    tok = tiny_tokenizer()
    assert tk.prefix_ids(tok) == ()
    bos, eos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A <|im_end|>", special_tokens=[("<|endoftext|>", bos), ("<|im_end|>", eos)])
    assert tok.encode("x")[0] == bos and tok.encode("x")[-1] == eos
    assert tk.prefix_ids(tok) == (bos,)
    ids, _, _ = tk.assemble(tk.plain_pieces(tok, [Piece(encode(tok, "ab"))]))
    assert ids.tolist() == [bos, *encode(tok, "ab")]


def test_pad_collate_pads_ids_labels_and_mask():
    a = {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([IGNORE, 6, 7]), "answer": "x"}
    b = {"input_ids": torch.tensor([8]), "labels": torch.tensor([8]), "answer": "y"}
    batch = tk.pad_collate([a, b], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["answer"] == ["x", "y"]


def test_cache_builds_once_and_rebuilds_when_the_file_is_damaged(cache_dir):
    calls = []

    def build():
        calls.append(1)
        return [{"input_ids": torch.tensor([1, 2]), "labels": torch.tensor([IGNORE, 2]), "note": None}]

    a = tk.cached("unit", {"x": 1}, build)
    b = tk.cached("unit", {"x": 1}, build)
    assert len(calls) == 1 and torch.equal(a[0]["input_ids"], b[0]["input_ids"]) and b[0]["note"] is None
    path = cache_dir / "data" / f"{a.info['key']}.pt"
    path.write_bytes(b"garbage")
    c = tk.cached("unit", {"x": 1}, build)
    assert len(calls) == 2 and isinstance(tk.TokenDataset.load(path), tk.TokenDataset) and len(c) == 1
    tk.cached("unit", {"x": 2}, build)
    assert len(calls) == 3


def test_tokenizer_fingerprint_follows_the_chat_template():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    assert tk.tokenizer_fingerprint(a) == tk.tokenizer_fingerprint(b)
    b.chat_template = "{{ messages[0]['content'] }}"
    assert tk.tokenizer_fingerprint(a) != tk.tokenizer_fingerprint(b)


def test_builders_are_found_by_name(cache_dir):
    from rolecall.data import build_dataset
    from rolecall.data.reasoning import build_reasoning_dataset

    tok = tiny_tokenizer()
    a = build_dataset("reasoning", tok, source="arithmetic:2")
    assert a.info["key"] == build_reasoning_dataset(tok, "arithmetic:2").info["key"] and len(a) == 2
    with pytest.raises(ValueError, match="unknown dataset 'books'.*passkey"):
        build_dataset("books", tok)
