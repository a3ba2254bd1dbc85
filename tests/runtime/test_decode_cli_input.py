"""``rolecall decode`` on the transformers path: ``--chat`` with a template runs, and its closing line says how
fast it went (the refusals of prompts that cannot run are in ``tests/test_bad_input.py``)."""

from __future__ import annotations

import json

import pytest

from rolecall.cli import main
from rolecall.cli.decode import chat_hint, transformers_line
from tests.tiny import tiny_folder, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_decode_with_chat_and_a_template_runs(tmp_path, capsys):
    assert tiny_tokenizer().chat_template  # the refusal without one is about the template, not --chat itself
    folder = tiny_folder(tmp_path / "tiny", "llama", layers=2, heads=4, kv_heads=2)
    assert main(["decode", "--model", str(folder), "--policy", "full", "--prompt", "hi", "--chat",
                 "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "[transformers path on cpu:" in err and "3 generated" in err and "tokens/s decoding" in err


def test_transformers_line_times_the_first_token_and_the_steps_after_it():
    # the call began at 0 s; new tokens at 0.25 s (prefill and one step), then 0.35 and 0.45: 2 tokens in 0.2 s
    line = transformers_line("cpu", 37, 3, [0.0, 0.25, 0.35, 0.45], 0.5, "delta")
    assert line == ("\n[transformers path on cpu: 37 prompt tokens, 3 generated, first token 250 ms, "
                    "10.0 tokens/s decoding; attended fraction 0.500 (policy delta)]")
    assert transformers_line("cpu", 5, 1, [0.0, 0.1], None, "full").endswith(
        "1 generated, first token 100 ms; no decode step ran (policy full)]")
    assert "first token" not in transformers_line("cpu", 5, 0, [0.0], None, "full")


def test_an_empty_completion_of_a_bare_prompt_points_to_chat():
    """Only where a completion is empty, the prompts went in bare and the model has a chat template."""
    tok = tiny_tokenizer()
    assert chat_hint(tok, False, 1, 1) == ("[the completion is empty: this model has a chat template; --chat wraps "
                                           "each prompt in it as a user turn]")
    assert chat_hint(tok, False, 2, 5).startswith("[2 of 5 completions are empty:")
    assert chat_hint(tok, True, 1, 1) is None and chat_hint(tok, False, 0, 3) is None

    class Base:
        chat_template = None

    assert chat_hint(Base(), False, 1, 1) is None


# -- --prompts: a file of prompts decoded in batches ------------------------------------------------------------
ROWS = [{"id": "a", "prompt": "hello there, friend"}, {"prompt": "hi", "id": "b"}, None,
        {"id": "c", "prompt": "the quick brown fox jumps", "answer": 3}]


def write_prompts(path, rows=ROWS):
    path.write_text("".join((json.dumps(r) if r is not None else "") + "\n" for r in rows))
    return str(path)


def decode_file(folder, prompts, out, *extra):
    return main(["decode", "--model", str(folder), "--policy", "full", "--prompts", prompts, "--out", str(out),
                 "--max-new-tokens", "5", *extra])


def test_a_prompt_file_gives_each_prompt_what_decoding_it_alone_gives(tmp_path, capsys):
    """Each line of --out is its prompt's row (its own keys first), the completion --prompt streams for it alone,
    and how it ended; the rows keep the file's order; the batches' file is gone once --out is written."""
    folder = tiny_folder(tmp_path / "tiny", "llama", layers=2, heads=4, kv_heads=2)
    out = tmp_path / "out.jsonl"
    assert decode_file(folder, write_prompts(tmp_path / "p.jsonl"), out) == 0
    err = capsys.readouterr().err
    assert "[transformers path on cpu: 3 prompts in 3 batches of up to 1, 15 generated in " in err
    assert f"wrote {out}]" in err and not (tmp_path / "out.jsonl.partial").exists()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == ["a", "b", "c"] and lines[2]["answer"] == 3
    assert list(lines[0]) == ["id", "prompt", "completion", "prompt_tokens", "new_tokens", "finish"]
    for row in lines:
        assert main(["decode", "--model", str(folder), "--policy", "full", "--prompt", row["prompt"],
                     "--max-new-tokens", "5"]) == 0
        assert capsys.readouterr().out.rstrip("\n") == row["completion"]
        assert row["new_tokens"] == 5 and row["finish"] == "length"
        assert row["prompt_tokens"] == len(tiny_tokenizer()(row["prompt"])["input_ids"])


def test_a_prompt_file_on_the_engine_in_ragged_batches_writes_the_same_bytes(tmp_path, capsys):
    """The engine (forced on the CPU) decodes the prompts two at a time, left-padded, shortest first; the file
    it writes is byte for byte the one the transformers path writes one prompt at a time."""
    folder = tiny_folder(tmp_path / "tiny", "llama", layers=2, heads=4, kv_heads=2)
    prompts = write_prompts(tmp_path / "p.jsonl")
    assert decode_file(folder, prompts, tmp_path / "one.jsonl") == 0
    assert decode_file(folder, prompts, tmp_path / "two.jsonl", "-p", "engine=static", "--batch-size", "2") == 0
    assert "[engine on cpu: 3 prompts in 2 batches of up to 2, 15 generated in " in capsys.readouterr().err
    assert (tmp_path / "two.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()


class Killed(Exception):
    """The process dying midway (a lost machine), as far as the files are concerned."""


def test_a_stopped_prompt_file_run_resumes_where_it_stopped(tmp_path, capsys, monkeypatch):
    """A run killed after its first batch keeps that batch; the rerun decodes only the rest and writes what an
    uninterrupted run writes. A rerun with other flags is refused rather than mixed in."""
    from rolecall.runtime.session import Session

    folder = tiny_folder(tmp_path / "tiny", "llama", layers=2, heads=4, kv_heads=2)
    prompts = write_prompts(tmp_path / "p.jsonl")
    assert decode_file(folder, prompts, tmp_path / "whole.jsonl") == 0
    out, calls, kill = tmp_path / "out.jsonl", [], [True]
    generate = Session.generate

    def killed_after_one(self, *a, **k):
        calls.append(1)
        if kill[0] and len(calls) > 1:
            raise Killed
        return generate(self, *a, **k)

    monkeypatch.setattr(Session, "generate", killed_after_one)
    with pytest.raises(Killed):
        decode_file(folder, prompts, out)
    partial = tmp_path / "out.jsonl.partial"
    assert not out.exists() and len(partial.read_text().splitlines()) == 2  # the header and one batch
    assert decode_file(folder, prompts, out, "--max-new-tokens", "6") == 2
    assert "holds the batches of another run" in capsys.readouterr().err
    calls.clear()
    kill[0] = False
    assert decode_file(folder, prompts, out) == 0
    assert len(calls) == 2 and "(1 batch kept from out.jsonl.partial)" in capsys.readouterr().err
    assert out.read_bytes() == (tmp_path / "whole.jsonl").read_bytes() and not partial.exists()
