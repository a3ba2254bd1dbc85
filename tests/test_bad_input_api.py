"""The Python API and the manifest reader keep the commands' promises: bad input is refused before any work, in one
line (a ``ValueError``) naming the value, the limit and the fix; never a torch error, never a silent wrong result.

Prompts through ``Session.generate``, ``rolecall.runtime.engine.generate`` and ``rolecall.eval.evaluate`` (one check,
``rolecall.runtime.prompts.check_prompts``, which ``rolecall decode`` and ``rolecall eval`` use too), manifests through
``RoleManifest.load`` and ``rolecall merge``/``inspect``, and DELTA's ``recent_pages`` through ``attach``. Decoding
is patched to fail the test wherever a refusal must come before it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import struct
import tracemalloc

import pytest
import torch

import rolecall.core.models
import rolecall.eval
import rolecall.eval.runner
from rolecall.cli import main as rolecall_main
from rolecall.core.manifest import (
    ManifestError,
    ModelIdentity,
    RoleManifest,
    UnverifiedManifestError,
    UnverifiedManifestWarning,
    content_sha256,
)
from rolecall.core.models import ContextLengthError
from rolecall.runtime import attach
from rolecall.runtime.policies import PolicyError
from rolecall.runtime.prompts import PromptError, check_prompts
from rolecall.runtime.session import Session
from tests.tiny import (
    SHORT_CONTEXT,
    VOCAB_SIZE,
    short_context_folder,
    tiny_config,
    tiny_model,
    tiny_tokenizer,
)

engine_generate = importlib.import_module("rolecall.runtime.engine.generate")  # the module (the package's name is the function)
pytestmark = pytest.mark.usefixtures("one_thread")
CONTEXT = SHORT_CONTEXT  # the tiny model's max_position_embeddings
TOP = VOCAB_SIZE - 1


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, max_position_embeddings=CONTEXT)


@pytest.fixture
def no_decoding(monkeypatch, model):
    """Decoding fails the test: a refused request must be refused before it."""
    def refuse(*a, **k):
        raise AssertionError("decoding started for a request that should have been refused")

    monkeypatch.setattr(Session, "_generate_static", refuse)
    monkeypatch.setattr(model, "generate", refuse)
    monkeypatch.setattr(engine_generate, "StaticDecoder", refuse)


def one_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"{prog}: error: "), err
    return err


def ids(rows: int = 2, tokens: int = 10) -> torch.Tensor:
    return torch.arange(rows * tokens).reshape(rows, tokens) % 250


# ---- prompts through Session.generate ---------------------------------------------------------------------------

VOCAB = f"the model's vocabulary has {VOCAB_SIZE} ids (0-{TOP}); re-tokenize it with this model's tokenizer"
BAD_PROMPTS = [
    ("id = vocab", dict(input_ids=torch.tensor([[1, 2], [3, VOCAB_SIZE]])),
     f"prompt 2 of input_ids has token id {VOCAB_SIZE}, {VOCAB}"),
    ("id 10**9", dict(input_ids=torch.tensor([[1, 10**9]])), f"prompt 1 of input_ids has token id 1000000000, {VOCAB}"),
    ("id -1", dict(input_ids=torch.tensor([[-1, 5]])), f"prompt 1 of input_ids has token id -1, {VOCAB}"),
    ("float tensor", dict(input_ids=ids().float()),
     "input_ids is a torch.float32 tensor, but token ids are integers; pass a torch.long tensor"),
    ("1-D tensor", dict(input_ids=ids()[0]),
     "input_ids is a 1-D tensor of shape (10,): one prompt without its batch dimension; pass input_ids[None] "
     "(shape [1, 10])"),
    ("bare list of ints", dict(input_ids=[5, 6, 7]),
     "input_ids is a list of numbers: one prompt without its batch dimension; pass a list of prompts, [input_ids], "
     "or a [1, 3] tensor"),
    ("bytes", dict(input_ids=b"hello"), "input_ids is bytes, not token ids; tokenize the text first"),
    ("empty prompt", dict(input_ids=torch.zeros(1, 0, dtype=torch.long)),
     "prompt 1 of input_ids is empty; every prompt needs at least one token"),
    ("mask keeps nothing", dict(input_ids=ids(), attention_mask=torch.tensor([[1] * 10, [0] * 10])),
     "prompt 2 of input_ids is empty (its attention_mask keeps none of its tokens)"),
    ("mask of another shape", dict(input_ids=ids(), attention_mask=torch.ones(2, 9, dtype=torch.long)),
     "attention_mask has shape (2, 9) but input_ids has shape (2, 10); pass one mask value per token"),
    ("mask values", dict(input_ids=ids(), attention_mask=torch.full((2, 10), 2)),
     "attention_mask row 1 holds 2; a mask takes 1 on a token and 0 on padding"),
    ("max_new_tokens 2.5", dict(input_ids=ids(), max_new_tokens=2.5),
     "max_new_tokens must be a whole number of tokens ≥ 1, got 2.5 (float); pass an int, e.g. max_new_tokens=64"),
    ("max_new_tokens 0", dict(input_ids=ids(), max_new_tokens=0),
     "max_new_tokens must be a whole number of tokens ≥ 1, got 0; generate at least 1 token"),
    ("max_new_tokens True", dict(input_ids=ids(), max_new_tokens=True),
     "max_new_tokens must be a whole number of tokens ≥ 1, got True (bool)"),
    ("list of lists", dict(input_ids=[[1, 2], [3, 4]]),
     "generate takes input_ids as a [batch, tokens] tensor, as model.generate does, not a list"),
    ("no input_ids", dict(max_new_tokens=3), "generate needs input_ids, a [batch, tokens] tensor of token ids"),
]


@pytest.mark.parametrize("engine", ["reference", "static"])
@pytest.mark.parametrize("case,kwargs,says", BAD_PROMPTS, ids=[c[0] for c in BAD_PROMPTS])
def test_session_generate_refuses_bad_prompts_before_decoding(model, no_decoding, engine, case, kwargs, says):
    with attach(model, None, "full", engine=engine) as session, pytest.raises(ValueError) as info:
        session.generate(**{"max_new_tokens": 4, **kwargs})
    message = str(info.value)
    assert says in message and "\n" not in message, message


def test_session_generate_takes_input_ids_positionally_and_checks_them(model, no_decoding):
    with attach(model, None, "full") as session, pytest.raises(PromptError, match=r"^input_ids is a 1-D tensor"):
        session.generate(ids()[0], max_new_tokens=3)


def test_session_generate_refuses_a_request_past_the_context_unless_allowed(model, monkeypatch):
    long = ids(1, 60)
    with attach(model, None, "full") as session:
        monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("decoded"))
        with pytest.raises(ContextLengthError) as info:
            session.generate(input_ids=long, max_new_tokens=10)
    assert str(info.value) == (
        f"the prompt of input_ids (60 tokens) plus max_new_tokens 10 is 70 tokens, more than the model's context of "
        f"{CONTEXT} (max_position_embeddings); shorten the prompt or lower max_new_tokens, or pass "
        "allow_long_context=True if you extended RoPE on purpose")
    monkeypatch.undo()
    # exactly the context fits; padding (masked ids) does not count against it
    padded = torch.cat([torch.zeros(1, 8, dtype=torch.long), ids(1, 54)], 1)
    mask = torch.cat([torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 54, dtype=torch.long)], 1)
    with attach(model, None, "full", engine="static") as session:
        out = session.generate(input_ids=padded, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert out.shape == (1, 72)
    with attach(model, None, "full", allow_long_context=True) as session:  # opted in: it runs, quietly
        assert session.generate(input_ids=long, max_new_tokens=10, do_sample=False).shape == (1, 70)
    with pytest.raises(PolicyError, match="allow_long_context must be True or False, got 'yes'"), \
            attach(model, None, "full", allow_long_context="yes"):
        pass


# ---- prompts through the engine's generate ----------------------------------------------------------------------

@pytest.mark.parametrize("prompts,new,error,says", [
    ([[1, 2, 3], [4, VOCAB_SIZE + 5]], 4, ValueError, f"prompt 2 of prompts has token id {VOCAB_SIZE + 5}, {VOCAB}"),
    ([[1, 2], [-1]], 4, ValueError, "prompt 2 of prompts has token id -1"),
    ([1, 2, 3], 4, PromptError, "prompts is a list of numbers: one prompt without its batch dimension"),
    (torch.tensor([1, 2, 3]), 4, PromptError, "prompts is a 1-D tensor of shape (3,)"),
    ([[1.0, 2.0]], 4, PromptError, "prompt 1 of prompts holds 1.0 (float) at position 0, but token ids are integers"),
    ([[1, True]], 4, PromptError, "prompt 1 of prompts holds True (bool) at position 1"),
    ([[1, 2], []], 4, PromptError, "prompt 2 of prompts is empty; every prompt needs at least one token"),
    ([], 4, PromptError, "prompts holds no prompt; pass at least one"),
    ([[1, 2], [3]], [4], PromptError, "max_new_tokens gives 1 values for 2 prompts; give one value, or one per prompt"),
    ([[1, 2], [3]], [4, 0], PromptError, "max_new_tokens of prompt 2 of prompts must be a whole number of tokens ≥ 1, "
                                         "got 0"),
    ([[1, 2]], 2.5, PromptError, "max_new_tokens must be a whole number of tokens ≥ 1, got 2.5 (float)"),
    ([[1] * 30], 4, ContextLengthError,
     "the prompt of prompts (30 tokens) plus max_new_tokens 4 is 34 tokens, more than the 32 positions of these "
     "weights' RoPE tables; shorten the prompt, lower max_new_tokens or build the weights with more positions"),
])
def test_engine_generate_refuses_bad_prompts_before_building_a_decoder(model, no_decoding, prompts, new, error, says):
    from rolecall.runtime.engine import Weights
    from rolecall.runtime.policies import get_policy

    weights = Weights.from_model(model, positions=32)
    with pytest.raises(error) as info:
        engine_generate.generate(weights, get_policy("full"), prompts, max_new_tokens=new)
    assert says in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_engine_generate_takes_a_batch_tensor(model):
    from rolecall.runtime.engine import Weights
    from rolecall.runtime.policies import get_policy

    weights = Weights.from_model(model, positions=64)
    as_rows = engine_generate.generate(weights, get_policy("full"), ids(2, 6).tolist(), max_new_tokens=3)
    as_tensor = engine_generate.generate(weights, get_policy("full"), ids(2, 6), max_new_tokens=3)
    assert as_rows.tokens == as_tensor.tokens and all(len(t) == 3 for t in as_rows.tokens)


# ---- prompts through the evaluation ----------------------------------------------------------------------------

class Reached(Exception):
    """The evaluation got past its checks to planning its batches."""


def sample(n: int, bad: int | None = None, **extra) -> dict:
    row = torch.arange(n) % 250
    if bad is not None:
        row[n // 2] = bad
    return {"input_ids": row, "answer": "x", "context_length": n, "depth": 0.5, **extra}


@pytest.mark.parametrize("samples,error,says", [
    ([sample(10), sample(10, VOCAB_SIZE)], ValueError, f"prompt 2 of samples has token id {VOCAB_SIZE}, {VOCAB}"),
    ([sample(10, -4)], ValueError, "prompt 1 of samples has token id -4"),
    ([sample(10), {"answer": "x"}], PromptError, "sample 2 of samples has no 'input_ids'"),
    ([{"input_ids": torch.arange(6.0)}], PromptError, "prompt 1 of samples is a torch.float32 tensor"),
    ([sample(10, max_new_tokens=1)], PromptError,
     "max_new_tokens of prompt 1 of samples must be a whole number of tokens ≥ 2 (the first token comes from the "
     "dense prefill), got 1"),
    ([sample(10), sample(60)], ContextLengthError,
     f"the longest prompt of samples (60 tokens) plus max_new_tokens 12 is 72 tokens, more than the model's context "
     f"of {CONTEXT} (max_position_embeddings); shorten the prompts or lower max_new_tokens, or pass "
     "allow_long_context=True"),
])
def test_evaluate_refuses_bad_samples_before_any_decoding(model, monkeypatch, samples, error, says):
    monkeypatch.setattr(rolecall.eval.runner, "_plan", lambda *a, **k: pytest.fail("the evaluation was planned"))
    with pytest.raises(error) as info:
        rolecall.eval.evaluate(model, tiny_tokenizer(), None, "full", samples=samples)
    assert says in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_evaluate_runs_past_the_context_only_when_allowed(model, monkeypatch):
    def reached(*a, **k):
        raise Reached

    monkeypatch.setattr(rolecall.eval.runner, "_plan", reached)
    with pytest.raises(ContextLengthError):
        rolecall.eval.evaluate(model, tiny_tokenizer(), None, "full", samples=[sample(60)])
    with pytest.raises(Reached):
        rolecall.eval.evaluate(model, tiny_tokenizer(), None, "full", samples=[sample(60)], allow_long_context=True)


def test_the_shared_check_returns_the_rows_the_mask_keeps():
    rows = check_prompts(torch.tensor([[9, 1, 2], [3, 4, 5]]), vocab_size=10, max_new_tokens=2,
                         attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]), context=5)
    assert rows == [[1, 2], [3, 4, 5]]
    with pytest.raises(PromptError, match=r"^attention_mask gives \[2, 1\] values per prompt but the prompts of "
                                          r"input_ids have \[2, 2\] tokens"):
        check_prompts([[1, 2], [3, 4]], vocab_size=10, max_new_tokens=2, attention_mask=[[1, 1], [1]])


# ---- prompts through the commands (the same check, in the flags' words) ------------------------------------------

@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    """A model of 200 token ids beside the byte tokenizer's 260: its specials are past the model's vocabulary."""
    return short_context_folder(tmp_path_factory.mktemp("tiny-200"), vocab_size=200, bos_token_id=0, eos_token_id=1,
                                pad_token_id=2)


def test_decode_refuses_ids_past_the_models_vocabulary_before_it_loads(small_vocab_dir, capsys, no_model):
    assert rolecall_main(["decode", "--model", str(small_vocab_dir), "--policy", "full", "--prompt", "hi <pad>"]) == 2
    err = one_line(capsys, "rolecall decode")
    assert err.endswith("--prompt has token id 259, the model's vocabulary has 200 ids (0-199); re-tokenize it with "
                        "this model's tokenizer")


def test_decode_refuses_a_prompt_past_the_context_unless_allowed(short_context_dir, capsys, monkeypatch):
    argv = ["decode", "--model", str(short_context_dir), "--policy", "full", "--prompt", "a" * 60, "--max-new-tokens", "8",
            "--device", "cpu"]
    with monkeypatch.context() as m:
        m.setattr(rolecall.core.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
        assert rolecall_main(argv) == 2
    err = one_line(capsys, "rolecall decode")
    assert err.endswith(f"--prompt (60 tokens) plus --max-new-tokens 8 is 68 tokens, more than the model's context of "
                        f"{CONTEXT} (max_position_embeddings); shorten the prompt or lower --max-new-tokens, or pass "
                        "--allow-long-context if you extended RoPE on purpose")
    assert rolecall_main([*argv, "--allow-long-context"]) == 0  # one warning, from the command; the session says none
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"rolecall decode: warning: --prompt (60 tokens) plus --max-new-tokens 8 is 68 tokens, more "
                        f"than the model's context of {CONTEXT} (max_position_embeddings); going on because of "
                        "--allow-long-context"]


@pytest.mark.parametrize("value", ["0", "-2"])
def test_decode_refuses_max_new_tokens_below_one_in_the_shared_words(small_vocab_dir, capsys, no_model, value):
    assert rolecall_main(["decode", "--model", str(small_vocab_dir), "--policy", "full", "--prompt", "hi",
                          "--max-new-tokens", value]) == 2
    assert one_line(capsys, "rolecall decode").endswith(
        f"--max-new-tokens must be a whole number of tokens ≥ 1, got {value}; generate at least 1 token")


def test_eval_refuses_a_prompt_file_past_the_models_vocabulary_before_it_loads(small_vocab_dir, tmp_path, capsys,
                                                                                no_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt": "a <|im_end|>"}) + "\n")
    assert rolecall_main(["eval", "--model", str(small_vocab_dir), "--policy", "full", "--prompts", str(prompts),
                          "--max-new-tokens", "3"]) == 2
    assert one_line(capsys, "rolecall eval").endswith(
        f"prompt 2 of {prompts} has token id 258, the model's vocabulary has 200 ids (0-199); re-tokenize it with "
        "this model's tokenizer")


# ---- manifests: values checked at load, naming the field ---------------------------------------------------------

def manifest(**kw) -> RoleManifest:
    config = tiny_config("llama", layers=4, heads=4, kv_heads=2)
    fields = dict(layer_role=[0, 1, 2, 2], layer_budget=[1.0, 0.5, 0.25, 0.25],
                  head_role=torch.tensor([[1, 1], [0, 1], [1, 0], [0, 0]], dtype=torch.int8))
    return RoleManifest(ModelIdentity.from_config(config, name="tiny"), **{**fields, **kw})


def rewritten(raw: bytes, change) -> bytes:
    """``raw`` with ``change(header, data)`` applied and its content hash made anew: a file rolecall could have
    written, but for the change (so only the value checks can refuse it)."""
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), bytearray(raw[8 + n:])
    change(header, data)
    header["__metadata__"]["content_sha256"] = content_sha256(header, bytes(data))
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(data)


def set_value(name: str, index: int, value) -> callable:
    def change(header, data):
        begin = header[name]["data_offsets"][0]
        if header[name]["dtype"] == "F32":
            data[begin + 4 * index:begin + 4 * index + 4] = struct.pack("<f", value)
        else:
            data[begin + index] = value & 0xFF
    return change


@pytest.mark.parametrize("change,says", [
    (set_value("layers.role", 2, 5), "layers.role[2] is 5, outside {0 full, 1 selection, 2 sparse}; re-create"),
    (set_value("layers.role", 0, -1), "layers.role[0] is -1, outside {0 full, 1 selection, 2 sparse}"),
    (set_value("heads.role", 3, 3), "heads.role[1, 1] is 3, outside {0 sparse, 1 retrieval}; re-create"),
    (set_value("layers.budget", 1, float("nan")), "layers.budget[1] is nan, not a fraction in (0, 1]: a Lethe budget "
                                                  "is the share of the context a layer keeps; re-run calibrate-delta"),
    (set_value("layers.budget", 2, float("inf")), "layers.budget[2] is inf, not a fraction in (0, 1]"),
    (set_value("layers.budget", 3, 0.0), "layers.budget[3] is 0.0, not a fraction in (0, 1]"),
    (set_value("layers.budget", 3, -0.0), "layers.budget[3] is -0.0, not a fraction in (0, 1]"),
    (set_value("layers.budget", 2, 1.0000001), "layers.budget[2] is 1.0000001192092896, not a fraction in (0, 1]"),
    (set_value("layers.budget", 0, 1.5), "layers.budget[0] is 1.5, not a fraction in (0, 1]"),
    (set_value("layers.budget", 0, -0.25), "layers.budget[0] is -0.25, not a fraction in (0, 1]"),
    (lambda h, d: h["__metadata__"].update({"model.num_layers": "5"}),
     "layers.role has shape (4,), expected (5,) for this model (5 layers, 2 KV heads)"),
    (lambda h, d: h["__metadata__"].update({"model.num_kv_heads": "1"}),
     "heads.role has shape (4, 2), expected (4, 1) for this model (4 layers, 1 KV heads)"),
])
def test_a_manifest_with_bad_values_is_refused_at_load_naming_the_field(tmp_path, change, says):
    path = tmp_path / "m.safetensors"
    path.write_bytes(rewritten(manifest().to_bytes(), change))
    with pytest.raises(ManifestError) as info:
        RoleManifest.load(path)
    assert str(info.value).startswith(f"{path}: ") and says in str(info.value), str(info.value)


def test_a_manifest_with_bad_budgets_cannot_be_built_either():
    with pytest.raises(ManifestError, match=r"^layers\.budget\[1\] is nan, not a fraction in \(0, 1\]"):
        manifest(layer_budget=[1.0, float("nan"), 0.5, 0.5])
    manifest(layer_budget=[1.0, 1e-4, 0.5, 0.5])  # small but kept: a fraction


# ---- manifests: the content hash -------------------------------------------------------------------------------

def without_hash(raw: bytes) -> bytes:
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    del header["__metadata__"]["content_sha256"]
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


def test_a_manifest_without_a_content_hash_loads_only_with_strict_false_and_says_so(tmp_path):
    path = tmp_path / "bare.safetensors"
    path.write_bytes(without_hash(manifest().to_bytes()))
    with pytest.raises(UnverifiedManifestError) as info:
        RoleManifest.load(path)
    assert str(info.value) == (
        f"{path}: written by rolecall but its 'content_sha256' is missing (edited, and its hash removed), so nothing "
        "shows its content is as written; if it is right, load it with RoleManifest.load(path, strict=False) (and "
        "save it: that adds a hash)")
    with pytest.warns(UnverifiedManifestWarning, match=f"^{path}: written by rolecall but .* loaded without "
                                                       r"verification \(strict=False\)$"):
        loaded = RoleManifest.load(path, strict=False)
    assert torch.equal(loaded.layer_role, manifest().layer_role)
    with pytest.raises(UnverifiedManifestError):  # attach() loads a path strictly too
        attach(tiny_model("llama", layers=4, heads=4, kv_heads=2), path, "delta").__enter__()


def test_merge_writes_no_hash_over_an_input_it_could_not_verify(tmp_path, capsys):
    layers = manifest(head_role=None).save(tmp_path / "layers.safetensors")
    heads = tmp_path / "heads.safetensors"
    heads.write_bytes(without_hash(manifest(layer_role=None, layer_budget=None).to_bytes()))
    out = tmp_path / "both.safetensors"
    assert rolecall_main(["merge", str(layers), str(heads), "-o", str(out)]) == 2
    err = one_line(capsys, "rolecall merge")
    assert f"{heads}: written by rolecall but its 'content_sha256' is missing" in err
    assert err.endswith("rolecall merge writes a content hash over its inputs, so it takes only inputs whose hash it "
                        "verified (the second one has none)")
    assert not out.exists()


@pytest.mark.parametrize("which", ["first", "second"])
def test_merge_refuses_an_output_that_is_one_of_its_inputs(tmp_path, capsys, which):
    layers = manifest(head_role=None).save(tmp_path / "layers.safetensors")
    heads = manifest(layer_role=None, layer_budget=None).save(tmp_path / "heads.safetensors")
    before = {p: p.read_bytes() for p in (layers, heads)}
    target = layers if which == "first" else heads
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    for output in (target, link):
        assert rolecall_main(["merge", str(layers), str(heads), "-o", str(output)]) == 2
        assert one_line(capsys, "rolecall merge").endswith(
            f"--output {output}: that is the {which} input ({target}); write the merged manifest to another path "
            "(then move it over the input if you mean to replace it)")
    assert {p: p.read_bytes() for p in (layers, heads)} == before


# ---- manifests: what a path is, and a large file of something else ------------------------------------------------

@pytest.mark.parametrize("given, says", [(b"\x00" * 64, "not a bytes; pass RoleManifest.from_bytes(data)"),
                                         (3, "not a int; pass its path"), (["a.safetensors"], "not a list; pass its path")])
def test_a_manifest_given_as_something_other_than_a_path_is_named(given, says):
    """Bytes or another object where a path goes: a one-line ManifestError naming the type, not torch's or the
    os module's TypeError (attach reads its manifest with RoleManifest.load)."""
    with pytest.raises(ManifestError, match=f"^a manifest is given by its path \\(str or os.PathLike\\) or as a "
                                            f"RoleManifest, {re.escape(says)}$"):
        RoleManifest.load(given)


def test_a_fifo_or_a_device_is_named_not_called_missing(tmp_path, capsys):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)  # reading it would wait for a writer: refused before anything opens it
    with pytest.raises(ManifestError, match=f"^{fifo}: a FIFO \\(named pipe\\), not a manifest file; give the path of a "
                                            r"manifest file \(\.safetensors\)$"):
        RoleManifest.load(fifo)
    with pytest.raises(ManifestError, match=r"^/dev/null: a character device, not a manifest file"):
        RoleManifest.load("/dev/null")
    assert rolecall_main(["inspect", "/dev/zero"]) == 2
    assert one_line(capsys, "rolecall inspect").endswith("/dev/zero: a character device, not a manifest file; give the "
                                                         "path of a manifest file (.safetensors)")
    assert rolecall_main(["inspect", str(fifo), "--verify"]) == 2
    assert "a FIFO (named pipe), not a manifest file" in one_line(capsys, "rolecall inspect")


GIB2 = 2 * 2**30


def sparse_file(path, head: bytes, size: int = GIB2):
    """``head`` then zeros up to ``size`` bytes, without writing them (a sparse file)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def weights_header() -> bytes:
    header = {"__metadata__": {"format": "pt"}, "model.embed": {"dtype": "F32", "shape": [GIB2 // 4 - 64],
                                                               "data_offsets": [0, GIB2 - 256]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("head,says", [
    (struct.pack("<Q", 16) + b"binary, not json", "not a rolecall manifest (header is not JSON)"),
    (b"\0" * 8, "not a rolecall manifest (header is not JSON)"),
    (struct.pack("<Q", 3 * 2**30), "more than the 67,108,864 a manifest's may take"),
    (weights_header(), "a safetensors file but not a rolecall manifest (its metadata 'format' is 'pt'"),
    (manifest().to_bytes(), "bytes follow its last tensor (a manifest's tensors fill its data exactly)"),
])
def test_a_large_file_of_something_else_is_refused_without_reading_it(tmp_path, head, says):
    path = sparse_file(tmp_path / "big.safetensors", head)
    assert path.stat().st_size == GIB2
    tracemalloc.start()
    try:
        with pytest.raises(ManifestError) as info:
            RoleManifest.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert says in str(info.value) and str(info.value).startswith(f"{path}: "), str(info.value)
    assert peak < 50 * 2**20, f"{peak / 2**20:.0f} MiB read for a refused file"


def test_the_header_length_is_checked_against_the_file_size(tmp_path):
    raw = manifest().to_bytes()
    path = tmp_path / "short.safetensors"
    n = struct.unpack("<Q", raw[:8])[0]
    path.write_bytes(raw[:8 + n // 2])
    with pytest.raises(ManifestError, match=f"^{path}: truncated: header needs {n} bytes but only {n // 2} follow$"):
        RoleManifest.load(path)
    data = len(raw) - 8 - n  # the last tensor in the file, in name order: layers.role
    path.write_bytes(raw[:-3])
    with pytest.raises(ManifestError, match=f"^{path}: truncated: tensor 'layers.role' ends at byte {data} of "
                                            f"{data - 3} data bytes$"):
        RoleManifest.load(path)


# ---- DELTA's recent pages through attach -------------------------------------------------------------------------

def test_attach_refuses_more_recent_pages_than_pages_as_calibrate_does():
    model = tiny_model("llama", layers=4, heads=4, kv_heads=2)
    layers = manifest(head_role=None)
    with pytest.raises(PolicyError) as info, attach(model, layers, "delta", budget=64, recent_pages=9):
        pass
    assert str(info.value) == ("policy 'delta': recent_pages=9 is more than the 4 pages read in all (budget=64 tokens "
                               "in pages of 16 gives num_pages=4; they count the recent pages too); pass "
                               "recent_pages ≤ 4, or a larger budget")
    with pytest.raises(PolicyError, match=r"recent_pages=3 is more than the 2 pages read in all \(num_pages is 2;"), \
            attach(model, layers, "delta", num_pages=2, recent_pages=3):
        pass
    with attach(model, layers, "delta", budget=64) as session:  # left out: the paper's 8, or all 4 pages here
        assert (session.policy.num_pages, session.policy.recent_pages) == (4, 4)
    with attach(model, layers, "delta", budget=64, recent_pages=4) as session:
        assert session.policy.recent_pages == 4
