"""How rolecall.core.models refuses bad ``--model`` values: one line naming the value, the limit and the fix.

No test touches the network: the Hub probe is replaced (or pointed at 127.0.0.1), and from_pretrained is
replaced wherever a regression could make it reach for the Hub.
"""

import http.server
import json
import shutil
import socket
import subprocess
import sys
import threading
import time

import huggingface_hub.constants
import pytest
import transformers

from rolecall.core import models
from rolecall.core.models import ModelNotFoundError, load_config, load_model, load_tokenizer
from tests.tiny import tiny_model, tiny_tokenizer

EMPTY_HINT = ("has no config.json; pass a folder saved with save_pretrained (config.json, weights, tokenizer "
              "files)")
CODE_HINT = "needs its own Python code (auto_map in config.json); rolecall runs it only with --trust-remote-code"
AUTO_MAP = {"AutoConfig": "configuration_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A complete tiny model folder, as save_pretrained writes it."""
    path = tmp_path_factory.mktemp("models") / "tiny"
    tiny_model("llama", layers=2).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def custom_copy(folder, dest, **extra):
    """A copy of ``folder`` whose config.json declares its own code, as a custom-architecture repo does."""
    shutil.copytree(folder, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(auto_map=AUTO_MAP, model_type="rolecall_custom", **extra)
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "configuration_custom.py").write_text("raise SystemExit('the folder code ran')\n")
    return dest


def no_prompt(*args, **kwargs):
    raise AssertionError(f"prompted on the terminal: {args}")


def forbid_from_pretrained(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("from_pretrained was called")

    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", fail)


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message and message.strip() == message
    return message


# --- row 5: a folder without config.json or without tokenizer files -------------------------------------

@pytest.mark.parametrize("load", [load_config, load_tokenizer, load_model])
def test_empty_folder_is_one_line_naming_config_json(tmp_path, monkeypatch, load):
    (tmp_path / "empty").mkdir()
    forbid_from_pretrained(monkeypatch)
    with pytest.raises(ModelNotFoundError) as err:
        load(str(tmp_path / "empty"))
    assert one_line(err) == f"model folder {tmp_path / 'empty'} {EMPTY_HINT}"


def test_folder_with_weights_but_no_config_json(tmp_path, folder):
    shutil.copytree(folder, tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(ModelNotFoundError) as err:
        load_tokenizer(str(tmp_path / "m"))
    assert "sentencepiece" not in one_line(err) and EMPTY_HINT in str(err.value)


def test_folder_without_tokenizer_files_says_so_when_the_tokenizer_loads(tmp_path):
    tiny_model("llama", layers=2).save_pretrained(tmp_path / "m")
    assert load_config(str(tmp_path / "m")).num_hidden_layers == 2  # config and model still load
    with pytest.raises(ModelNotFoundError) as err:
        load_tokenizer(str(tmp_path / "m"))
    message = one_line(err)
    assert message.startswith(f"model folder {tmp_path / 'm'} has config.json but no tokenizer files")
    assert "tokenizer.save_pretrained(" in message and "sentencepiece" not in message


def test_unreadable_config_json_is_one_line(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ModelNotFoundError) as err:
        load_config(str(tmp_path / "m"))
    assert "config.json is not readable JSON" in one_line(err)


# --- row 6: custom code (auto_map) ---------------------------------------------------------------------

@pytest.mark.parametrize("load", [load_config, load_tokenizer, load_model])
def test_auto_map_folder_is_refused_without_a_prompt(tmp_path, folder, monkeypatch, load):
    custom = custom_copy(folder, tmp_path / "custom")
    monkeypatch.setattr("builtins.input", no_prompt)
    forbid_from_pretrained(monkeypatch)
    with pytest.raises(ModelNotFoundError) as err:
        load(str(custom))
    assert one_line(err) == f"model folder {custom} {CODE_HINT}"


def test_auto_map_in_tokenizer_config_is_refused(tmp_path, folder, monkeypatch):
    shutil.copytree(folder, tmp_path / "m")
    path = tmp_path / "m" / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "auto_map": {"AutoTokenizer": ["tok.T", None]}}))
    monkeypatch.setattr("builtins.input", no_prompt)
    with pytest.raises(ModelNotFoundError, match=r"auto_map in tokenizer_config\.json.*--trust-remote-code"):
        load_tokenizer(str(tmp_path / "m"))


def test_auto_map_refusal_in_a_fresh_process_with_stdin_closed(tmp_path, folder):
    """Without the refusal, transformers asks "[y/N]" (and would run configuration_custom.py on "y")."""
    custom = custom_copy(folder, tmp_path / "custom")
    code = ("import sys\nfrom rolecall.core.models import load_config\ntry:\n    load_config(sys.argv[1])\n"
            "except OSError as e:\n    print(e)\n    sys.exit(2)\n")
    out = subprocess.run([sys.executable, "-c", code, str(custom)], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr[-2000:]
    assert "[y/N]" not in out.stdout + out.stderr and "the folder code ran" not in out.stdout + out.stderr
    assert out.stdout.strip().splitlines() == [f"model folder {custom} {CODE_HINT}"]


def test_every_load_passes_trust_remote_code_explicitly(folder, monkeypatch):
    seen = []

    def spy(cls):
        real = cls.from_pretrained

        def call(*args, **kwargs):
            seen.append((cls.__name__, kwargs.get("trust_remote_code", "missing")))
            return real(*args, **kwargs)
        monkeypatch.setattr(cls, "from_pretrained", call)

    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        spy(cls)
    load_config(str(folder))
    load_tokenizer(str(folder))
    load_model(str(folder), dtype="float32")
    assert {name for name, _ in seen} == {"AutoConfig", "AutoTokenizer", "AutoModelForCausalLM"}
    assert all(flag is False for _, flag in seen), seen  # transformers' inner calls inherit it too


def test_trust_remote_code_true_lets_an_auto_map_folder_through(tmp_path, folder, monkeypatch):
    custom = custom_copy(folder, tmp_path / "custom")
    seen = {}

    def fake(where, **kwargs):
        seen.update(kwargs, where=where)
        return "config"
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fake)
    assert load_config(str(custom), trust_remote_code=True) == "config"
    assert seen == {"where": str(custom), "trust_remote_code": True}


# --- row 4: a hub id that is not cached, with no network -----------------------------------------------

@pytest.fixture
def online(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE unset and an empty Hugging Face cache; the probe answers what the test says."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    probes = []

    def set_reachable(answer):
        def probe(*args, **kwargs):
            probes.append(args)
            return answer
        monkeypatch.setattr(models, "_hub_reachable", probe)
        return probes
    return set_reachable


def fake_cached(tmp_path, repo, config):
    snapshot = tmp_path / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("a" * 40)
    return snapshot


def test_an_alias_config_is_bundled_and_needs_no_network(online, monkeypatch):
    probes = online(False)
    forbid_from_pretrained(monkeypatch)
    config = load_config("qwen-14b")
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("qwen2", 48, 8)
    assert config._name_or_path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B" and not probes


@pytest.mark.parametrize("load", [load_tokenizer, load_model])
def test_uncached_alias_without_network_fails_at_once(online, monkeypatch, load):
    probes = online(False)
    forbid_from_pretrained(monkeypatch)  # no hub retries: transformers is never asked
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError) as err:
        load("qwen-14b")
    assert time.monotonic() - start < 3
    message = one_line(err)
    assert message.startswith("model 'qwen-14b' (deepseek-ai/DeepSeek-R1-Distill-Qwen-14B) is not available offline")
    assert "hf download deepseek-ai/DeepSeek-R1-Distill-Qwen-14B" in message and "--model /path/to/" in message
    assert len(probes) == 1


def test_hf_hub_offline_means_no_probe(online, monkeypatch):
    online(True)
    monkeypatch.setattr(models, "_hub_reachable", lambda *a, **k: pytest.fail("probed with HF_HUB_OFFLINE=1"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as err:
        load_config("rolecall-test/does-not-exist")
    assert "rolecall-test/does-not-exist" in one_line(err)


def test_reachable_hub_leaves_from_pretrained_alone(online, monkeypatch):
    online(True)
    seen = {}
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda where, **kw: seen.update(kw, where=where))
    load_config("deepseek-ai/DeepSeek-R1-Distill-Qwen-14B")
    assert seen["where"] == "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B" and "local_files_only" not in seen
    assert seen["trust_remote_code"] is False


def test_cached_model_without_network_reads_only_the_cache(online, tmp_path, monkeypatch):
    probes = online(False)
    fake_cached(tmp_path, "rolecall-test/cached", {"model_type": "llama"})
    seen = {}
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda where, **kw: seen.update(kw, where=where))
    load_config("rolecall-test/cached")
    assert seen == {"where": "rolecall-test/cached", "local_files_only": True, "trust_remote_code": False}
    assert len(probes) == 1


def test_cached_hub_model_with_auto_map_is_refused(online, tmp_path, monkeypatch):
    online(True)
    fake_cached(tmp_path, "rolecall-test/custom", {"model_type": "rolecall_custom", "auto_map": AUTO_MAP})
    forbid_from_pretrained(monkeypatch)
    with pytest.raises(ModelNotFoundError) as err:
        load_config("rolecall-test/custom")
    assert one_line(err) == ("model 'rolecall-test/custom' needs its own Python code (auto_map in config.json); "
                             "rolecall runs it only with --trust-remote-code")


# --- the probe itself, against 127.0.0.1 only ----------------------------------------------------------

def test_probe_sees_a_closed_port_as_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends
    start = time.monotonic()
    assert models._hub_reachable(f"http://127.0.0.1:{port}", timeout=1.0) is False
    assert time.monotonic() - start < 2


def test_probe_gives_up_on_a_silent_server_after_its_timeout():
    with socket.socket() as server:  # accepts connections (backlog) but never answers
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        start = time.monotonic()
        assert models._hub_reachable(f"http://127.0.0.1:{server.getsockname()[1]}", timeout=0.5) is False
        assert time.monotonic() - start < 1.5


def test_probe_sees_any_http_answer_as_reachable():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert models._hub_reachable(f"http://127.0.0.1:{server.server_address[1]}", timeout=1.0) is True
    finally:
        server.shutdown()
        server.server_close()


# --- the commands: --trust-remote-code reaches every load ----------------------------------------------

@pytest.mark.parametrize("command", ["decode", "eval"])
def test_commands_refuse_custom_code_unless_asked(tmp_path, folder, monkeypatch, capsys, command):
    from rolecall.cli import main

    custom = custom_copy(folder, tmp_path / "custom")
    monkeypatch.setattr("builtins.input", no_prompt)
    extra = ["--prompt", "hi"] if command == "decode" else ["--lengths", "40"]
    assert main([command, "--model", str(custom), "--policy", "full", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert CODE_HINT in err and "\n" not in err
    seen = []

    def fake(where, **kwargs):  # with the flag, the loads ask transformers to trust the folder's code
        seen.append(kwargs.get("trust_remote_code"))
        raise OSError("stop here")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fake)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake)
    assert main([command, "--model", str(custom), "--policy", "full", "--trust-remote-code", *extra]) == 2
    assert seen and all(flag is True for flag in seen)
