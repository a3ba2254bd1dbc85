"""Calibration traces: token ids of a prompt followed by the model's own answer.

Either generated once by the model from reasoning prompts (``data.reasoning``) and cached on disk under
``runtime.models.cache_dir() / "traces"``, keyed by the model, the prompts and the generation settings, so a
second run with the same settings reuses them; or read from a JSONL file (``--traces``) whose lines are
``{"text": "..."}``, ``{"ids": [...]}`` (or ``"input_ids"``), or a bare JSON string.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from data.jsonl import iter_jsonl
from data.tokens import check_token_ids
from runtime.atomic import write_text


class TraceError(ValueError):
    """Traces could not be read or made (the message names the file or setting and the fix)."""


def traces_sha256(traces: list[list[int]]) -> str:
    """Hash of the token ids, in order: what the manifest's ``data`` records as the calibration data."""
    h = hashlib.sha256()
    for ids in traces:
        h.update(json.dumps(list(ids), separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def read_traces(path: str | os.PathLike, tokenizer: Any = None) -> list[list[int]]:
    """Token-id traces from a JSONL file; text lines are tokenised with ``tokenizer`` (no special tokens added:
    the text is taken to be the full trace, chat markup included)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"traces file {path}: no such file; pass --traces with a JSONL file of texts or token ids")
    out = []
    for number, doc in iter_jsonl(path, TraceError, '{"text": ...} or {"ids": [...]}'):
        if isinstance(doc, dict):
            doc = doc.get("ids", doc.get("input_ids", doc.get("text")))
        if isinstance(doc, str):
            if tokenizer is None:
                raise TraceError(f"{path}:{number}: a text trace needs a tokenizer")
            doc = tokenizer(doc, add_special_tokens=False)["input_ids"]
        if not (isinstance(doc, list) and doc and all(isinstance(t, int) for t in doc)):
            raise TraceError(f"{path}:{number}: expected a non-empty text or list of token ids, "
                             "e.g. {\"ids\": [1, 2, 3]}")
        out.append(doc)
    if not out:
        raise TraceError(f"traces file {path} holds no traces; add one JSON object per line")
    check_token_ids(out, None, f"trace {{n}} of {path}")  # a negative id; the CLI checks the model's vocabulary
    return out


def write_traces(path: Path, traces: list[list[int]]) -> None:
    """Atomic JSONL write (temporary file, then rename)."""
    write_text(path, "".join(json.dumps({"ids": list(ids)}, separators=(",", ":")) + "\n" for ids in traces))


def load_prompts(source: str, limit: int) -> list[str]:
    from data.reasoning import load_prompts as load

    return load(source, limit=limit)


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def trace_cache_path(model, prompts: list[str], settings: dict[str, Any]) -> Path:
    from runtime.manifest import config_sha256
    from runtime.models import cache_dir

    spec = getattr(model, "rolecall_spec", None)
    name = spec.name if spec is not None else str(getattr(model.config, "_name_or_path", "") or "model")
    key = json.dumps({"model": name, "arch": config_sha256(model.config), "dtype": str(model.dtype),
                      "prompts": prompts, **settings}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return cache_dir() / "traces" / f"{safe}-{digest}.jsonl"


class _StepCounter:
    """A logits processor that only advances a progress bar: generate() calls it once per decoding step."""

    def __init__(self, bar):
        self.bar = bar

    def __call__(self, input_ids, scores):
        self.bar.update(1)
        return scores


def generate_traces(model, tokenizer, prompts: list[str], max_new_tokens: int, sample: bool = False,
                    temperature: float = 0.6, top_p: float = 0.95, seed: int = 0, batch_size: int = 8,
                    cache: bool = True, progress: bool = True) -> list[list[int]]:
    """One trace per prompt: the chat-formatted prompt's ids and the model's answer, ended by its EOS token.

    Prompts are generated ``batch_size`` at a time with left padding; the padding is removed again.
    """
    from tqdm.auto import tqdm
    from transformers import LogitsProcessorList

    from data.reasoning import format_prompt

    if not prompts:
        raise TraceError("no calibration prompts; pass --prompts with a source that has some")
    settings = {"max_new_tokens": max_new_tokens, "sample": sample, "seed": seed, "batch_size": batch_size,
                **({"temperature": temperature, "top_p": top_p} if sample else {})}
    path = trace_cache_path(model, prompts, settings)
    if cache and path.is_file():
        return read_traces(path)
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    device = model.get_input_embeddings().weight.device
    encoded = [tokenizer(format_prompt(tokenizer, p), add_special_tokens=False)["input_ids"] for p in prompts]
    generator_seed = torch.Generator().manual_seed(seed)
    traces = []
    batches = -(-len(encoded) // batch_size)
    bar = tqdm(total=batches * max_new_tokens, desc=f"generating {len(prompts)} traces", unit="step",
               disable=not progress)
    steps = LogitsProcessorList([_StepCounter(bar)])
    for i in range(0, len(encoded), batch_size):
        batch = encoded[i : i + batch_size]
        width = max(len(x) for x in batch)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=device)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=generator_seed)))
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 min_new_tokens=1, do_sample=sample, pad_token_id=pad, logits_processor=steps,
                                 **({"temperature": temperature, "top_p": top_p} if sample else
                                    {"temperature": None, "top_p": None, "top_k": None}))
        for prompt_ids, row in zip(batch, out[:, width:].tolist()):
            answer = []
            for t in row:
                answer.append(t)
                if t in eos:
                    break
            traces.append(prompt_ids + answer)
        bar.n = (i // batch_size + 1) * max_new_tokens  # a batch that stopped early at EOS
        bar.refresh()
    bar.close()
    if cache:
        write_traces(path, traces)
    return traces
