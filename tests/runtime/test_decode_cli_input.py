"""``rolecall decode`` on the transformers path: ``--chat`` with a template runs, and its closing line says how
fast it went (the refusals of prompts that cannot run are in ``tests/test_bad_input.py``)."""

from __future__ import annotations

import pytest

from runtime.cli import main
from runtime.cli.decode import transformers_line
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
