"""``rolecall decode`` and ``rolecall eval``: prompts and flags that cannot run are refused before the weights load,
in one line; the transformers path's closing line says how fast it went."""

from __future__ import annotations

import json

import pytest

import runtime.models
from runtime.cli import main
from runtime.cli.decode import transformers_line
from tests.tiny import tiny_folder, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("tiny-decode"), "llama", layers=2, heads=4, kv_heads=2)


@pytest.fixture
def no_model(monkeypatch):
    """Loading weights fails the test: refused input must be refused before that."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded for input that should have been refused")

    monkeypatch.setattr(runtime.models, "load_model", refuse)


def one_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"{prog}: error: ")
    return err


@pytest.mark.parametrize("prompt", ["", "   "])
def test_decode_refuses_an_empty_prompt_before_the_model_loads(model_dir, capsys, no_model, prompt):
    assert main(["decode", "--model", str(model_dir), "--policy", "full", "--prompt", prompt]) == 2
    assert "--prompt is empty" in one_line(capsys, "rolecall decode")


def test_decode_refuses_chat_without_a_template_before_the_model_loads(tmp_path, capsys, no_model):
    folder = tiny_folder(tmp_path / "base", "llama", layers=2, heads=4, kv_heads=2)
    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings.pop("chat_template", None)
    config.write_text(json.dumps(settings))
    for extra in folder.glob("chat_template.*"):  # newer tokenizers keep the template in a file of its own
        extra.unlink()
    capsys.readouterr()  # saving the folder's progress
    assert main(["decode", "--model", str(folder), "--policy", "full", "--prompt", "hi", "--chat"]) == 2
    err = one_line(capsys, "rolecall decode")
    assert "has no chat template" in err and "leave out --chat" in err


def test_decode_with_chat_and_a_template_runs(model_dir, capsys):
    assert tiny_tokenizer().chat_template  # the refusal above is about the template, not --chat itself
    assert main(["decode", "--model", str(model_dir), "--policy", "full", "--prompt", "hi", "--chat",
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


@pytest.mark.parametrize("flag", ["--samples-per-cell", "--passkey-words"])
def test_eval_refuses_zero_counts_in_the_flags_words(model_dir, capsys, no_model, flag):
    assert main(["eval", "--model", str(model_dir), "--policy", "full", flag, "0"]) == 2
    assert f"{flag} must be at least 1, got 0" in one_line(capsys, "rolecall eval")
