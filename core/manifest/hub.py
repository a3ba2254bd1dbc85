"""A manifest as a Hugging Face Hub-ready folder, and reading one back.

``rolecall export MANIFEST --format hub --base-model M -o DIR`` writes

- ``manifest.safetensors``: the manifest's bytes, unchanged (its content hash still verifies);
- ``README.md``: a model card, YAML front matter first (``base_model``, ``library_name: rolecall``, ``tags``),
  then what the manifest holds (Δ-layers, retrieval heads), how it was made (the settings in its ``config``) and
  how to use it;
- ``layers.json`` (a layers section) and ``duo/`` (a heads section): the layer list and DuoAttention pattern of
  ``rolecall export --format layers`` / ``duo``, for runtimes that read those.

Before anything is written, the manifest is checked against the base model's config (:meth:`RoleManifest.validate_for`):
a manifest made for another model is refused in one line. The folder is the same bytes for the same manifest and
base model: no dates, no paths. Upload it with ``huggingface-cli upload <repo> DIR``.

Reading: :func:`resolve_manifest_path` turns what a user passes as ``--manifest`` into a file: the file itself, a
folder holding ``manifest.safetensors``, or a Hub repo id found in the local Hugging Face cache (offline: one line
naming the id when it is not there).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rolecall.core.atomic import write_bytes, write_text
from rolecall.core.manifest import ManifestError, RoleManifest
from rolecall.core.manifest.recommended import evidence_text, setting_text

MANIFEST_FILE = "manifest.safetensors"


def base_model_id(name: str) -> str:
    """The Hub id a card names for ``name``: an alias's Hugging Face id, else the name as given."""
    from rolecall.core.models import resolve_model

    spec = resolve_model(name)
    return spec.hf_id or name


def model_card(manifest: RoleManifest, base_model: str) -> str:
    """The ``README.md`` of a hub folder (deterministic: the same manifest and base model, the same text)."""
    sections = manifest.sections
    tags = ["rolecall", "sparse-attention", "long-context"]
    tags += ["delta"] if "layers" in sections else []
    tags += ["lycheedecode", "retrieval-heads"] if "heads" in sections else []
    front = ["---", f"base_model: {base_model}", "library_name: rolecall", "tags:", *[f"- {t}" for t in tags], "---"]
    m = manifest.model
    lines = [*front, "", f"# rolecall role manifest for {base_model}", "",
             f"Attention roles for `{base_model}` ({m.num_layers} layers, {m.num_heads} query heads, "
             f"{m.num_kv_heads} KV heads of {m.head_dim}), for rolecall's sparse decoding.", ""]
    if "layers" in sections:
        lines += [f"- **Layers** (DELTA): Δ-layers {manifest.delta_layers}; the first layers and the Δ-layers run full "
                  "attention and choose pages, the others read the pages the Δ-layer before them chose."]
    if "heads" in sections:
        heads = manifest.retrieval_heads
        past_zero = [h for h in heads if h[0] > 0]
        lines += [f"- **Heads** (LycheeDecode): {len(past_zero)} retrieval KV heads past layer 0 "
                  f"({len(heads)} with layer 0's), the others attend to the blocks the same head chose a layer "
                  "before."]
    if manifest.config:
        made = json.dumps({k: v for k, v in sorted(manifest.config.items()) if k not in ("output",)}, sort_keys=True)
        lines += ["", "Made with these settings (the manifest's `config`):", "", "```json", made, "```"]
    if manifest.metrics:
        keep = {k: v for k, v in sorted(manifest.metrics.items()) if isinstance(v, (int, float, str))}
        if keep:
            lines += ["", "Its metrics:", "", "```json", json.dumps(keep, sort_keys=True), "```"]
    lines += recommended_lines(manifest)
    policy = "" if manifest.recommended else " --policy delta" if "layers" in sections else " --policy lychee"
    given = "" if manifest.recommended else ", \"delta\"" if "layers" in sections else ", \"lychee\""
    lines += ["", "## Use", "", "```bash", "pip install rolecall",
              f"rolecall decode --model {base_model} --manifest <this folder or repo id>{policy} "
              "--prompt \"...\"", "```", "", "```python", "from rolecall.runtime import attach", "",
              f"with attach(model, \"<this folder>\"{given}) as session:",
              "    out = session.generate(**inputs, max_new_tokens=256)", "```", "",
              "Files: `manifest.safetensors` (the manifest; `rolecall inspect --verify` checks its content hash)"
              + (", `layers.json` (the layer list)" if "layers" in sections else "")
              + (", `duo/` (a DuoAttention pattern)" if "heads" in sections else "") + "."]
    return "\n".join(lines) + "\n"


def recommended_lines(manifest: RoleManifest) -> list[str]:
    """The card's section on the recommended setting (``rolecall tune``), empty without one."""
    r = manifest.recommended
    if not r:
        return []
    evidence = r.get("evidence", {})
    lines = ["", "## Recommended setting", "", f"`{setting_text(r['policy'], r.get('params', {}))}`, chosen by "
             f"`rolecall tune` as the cheapest setting within {evidence.get('max_drop', '?')} points of full attention "
             f"({evidence_text(evidence) or 'no evidence recorded'}). Decoding with this manifest and no policy named "
             "uses it."]
    if evidence.get("command"):
        lines += ["", "Made with:", "", "```bash", evidence["command"], "```"]
    return lines


def export_hub(manifest: RoleManifest, raw: bytes, out: str | os.PathLike, base_model: str, config: Any) -> Path:
    """Write the hub folder of ``manifest`` (read from the bytes ``raw``, copied as they are) to ``out`` for
    ``base_model`` (its Hub id or an alias), after checking the manifest against ``config``, the base model's."""
    from rolecall.core.manifest.interop import export_manifest

    try:
        manifest.validate_for(config)
    except ValueError as e:
        raise ManifestError(f"--base-model {base_model}: {' '.join(str(e).split())}") from None
    hub_id = base_model_id(base_model)
    out = Path(out)
    write_bytes(out / MANIFEST_FILE, raw)
    write_text(out / "README.md", model_card(manifest, hub_id))
    if "layers" in manifest.sections:
        export_manifest(manifest, "layers", out / "layers.json")
    if "heads" in manifest.sections:
        export_manifest(manifest, "duo", out / "duo")
    return out


def resolve_manifest_path(given: str | os.PathLike) -> str | os.PathLike:
    """What ``--manifest`` names, as a file: the path itself when it is not a folder holding a hub export, the
    ``manifest.safetensors`` in a folder that holds one, or for ``owner/name`` that is no path here, the file in
    the local Hugging Face cache (a :class:`ManifestError` naming the id when it is not there)."""
    path = Path(given)
    if path.is_dir() and (path / MANIFEST_FILE).is_file():
        return path / MANIFEST_FILE
    text = str(given)
    if not path.exists() and text.count("/") == 1 and not text.startswith((".", "/", "~")) and \
            not text.endswith(".safetensors"):
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return given
        found = try_to_load_from_cache(text, MANIFEST_FILE)
        if isinstance(found, str):
            return found
        raise ManifestError(f"{text}: no such file here, and no Hub repo of that id in the local Hugging Face cache; "
                            f"download it where there is network (hf download {text}) or pass the file's path")
    return given


__all__ = ["MANIFEST_FILE", "export_hub", "model_card", "resolve_manifest_path"]
