"""Calibration traces generated on rolecall's engine are the traces transformers generates, and share its cache."""

import pytest
import torch

import rolecall.calibrate.traces as traces_mod
from rolecall.calibrate.traces import engine_refusal, generate_traces, trace_cache_path
from rolecall.data.reasoning import format_prompt
from tests.tiny import tiny_model, tiny_tokenizer

PROMPTS = ["x", "a longer prompt, of several words", "mid size one", "7 + 5 = ?"]  # ragged lengths


@pytest.fixture
def model_and_tok(one_thread):
    return tiny_model("qwen2", seed=3).float().eval(), tiny_tokenizer()


def both(model, tok, **kw):
    kw = dict(max_new_tokens=20, cache=False, progress=False, **kw)
    return (generate_traces(model, tok, PROMPTS, engine="engine", **kw),
            generate_traces(model, tok, PROMPTS, engine="transformers", **kw))


def test_greedy_engine_traces_equal_transformers_traces_token_for_token(model_and_tok):
    model, tok = model_and_tok
    engine, hf = both(model, tok)
    assert engine == hf and len(engine) == len(PROMPTS)
    assert all(len(t) > len(tok(format_prompt(tok, p), add_special_tokens=False)["input_ids"])
               for t, p in zip(engine, PROMPTS))


def test_rows_that_end_at_eos_and_an_eos_first_end_as_transformers_ends_them(model_and_tok):
    """Two more EOS ids: a token from the middle of one row's answer (that row ends there, the others run on) and
    the first answer token of another (transformers' min_new_tokens=1 refuses it there: the engine's row is made
    again through transformers)."""
    model, tok = model_and_tok
    plain, _ = both(model, tok)
    prompt_lengths = [len(tok(format_prompt(tok, p), add_special_tokens=False)["input_ids"]) for p in PROMPTS]
    assert all(len(t) - n == 20 for t, n in zip(plain, prompt_lengths))  # no EOS of its own in 20 tokens
    answers = [t[n:] for t, n in zip(plain, prompt_lengths)]
    firsts = {a[0] for a in answers}
    # a token that first shows in the middle of a row's answer and starts no answer: that row ends there
    row, at = next((r, i) for r, a in enumerate(answers) for i in range(3, 20)
                   if a[i] not in a[:i] and a[i] not in firsts)
    middle = answers[row][at]
    other = next(r for r in range(len(answers)) if r != row and middle not in answers[r])
    first = answers[other][0]
    model.generation_config.eos_token_id = [258, middle, first]
    engine, hf = both(model, tok)
    assert engine == hf
    assert engine[row] == plain[row][:prompt_lengths[row] + at + 1]  # ends with its EOS, nothing after
    assert len(engine[other]) > prompt_lengths[other] + 1  # not the EOS as its only answer token
    assert engine[other][prompt_lengths[other]] != first


def test_the_cache_written_by_one_path_serves_the_other(model_and_tok, cache_dir, monkeypatch):
    model, tok = model_and_tok
    written = generate_traces(model, tok, PROMPTS, max_new_tokens=12, engine="transformers", progress=False)
    assert trace_cache_path(model, PROMPTS, {"max_new_tokens": 12, "sample": False, "seed": 0, "batch_size": 8}).is_file()
    monkeypatch.setattr(traces_mod, "_on_engine", lambda *a, **k: pytest.fail("the cache was not read"))
    assert generate_traces(model, tok, PROMPTS, max_new_tokens=12, engine="engine", progress=False) == written


def test_sampled_engine_traces_are_cached_apart_and_repeat_for_a_seed(model_and_tok, cache_dir):
    model, tok = model_and_tok
    a = generate_traces(model, tok, PROMPTS, max_new_tokens=12, sample=True, seed=4, engine="engine", progress=False)
    b = generate_traces(model, tok, PROMPTS, max_new_tokens=12, sample=True, seed=4, engine="engine", cache=False,
                        progress=False)
    assert a == b
    settings = {"max_new_tokens": 12, "sample": True, "seed": 4, "batch_size": 8, "temperature": 0.6, "top_p": 0.95}
    assert not trace_cache_path(model, PROMPTS, settings).is_file()  # transformers' sampled key is not taken
    assert trace_cache_path(model, PROMPTS, {**settings, "sampler": "engine"}).is_file()


def test_auto_says_why_it_generates_through_transformers(model_and_tok, capsys):
    model, tok = model_and_tok
    assert engine_refusal(model) == "the model is on the CPU"
    auto = generate_traces(model, tok, PROMPTS[:2], max_new_tokens=6, cache=False)
    assert "generating traces through transformers: the model is on the CPU" in capsys.readouterr().err
    assert auto == generate_traces(model, tok, PROMPTS[:2], max_new_tokens=6, cache=False, engine="transformers",
                                   progress=False)
    with pytest.raises(ValueError, match="engine must be 'auto', 'engine' or 'transformers', got 'gpu'"):
        generate_traces(model, tok, PROMPTS, max_new_tokens=6, engine="gpu")


def test_zero3_and_device_maps_are_named():
    m = torch.nn.Linear(2, 2)
    m.weight.ds_id = 1
    assert engine_refusal(m) == "ZeRO-3 partitions the weights"
    spread = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    assert engine_refusal(spread) == "the weights are spread over 2 devices (a device map)"
