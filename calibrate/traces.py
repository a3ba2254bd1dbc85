"""Calibration traces: token ids of a prompt followed by the model's own answer.

Either generated once by the model from reasoning prompts (``rolecall.data.reasoning``) and cached on disk under
``rolecall.core.models.cache_dir() / "traces"``, keyed by the model, the prompts and the generation settings, so a
second run with the same settings reuses them; or read from a JSONL file (``--traces``) whose lines are
``{"text": "..."}``, ``{"ids": [...]}`` (or ``"input_ids"``), or a bare JSON string.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from rolecall.core.atomic import write_text
from rolecall.core.tokens import check_token_ids
from rolecall.data.jsonl import iter_jsonl


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
    from rolecall.data.reasoning import load_prompts as load

    return load(source, limit=limit)


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def trace_cache_path(model, prompts: list[str], settings: dict[str, Any]) -> Path:
    from rolecall.core.manifest import config_sha256
    from rolecall.core.models import cache_dir

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


def engine_refusal(model) -> str | None:
    """Why the engine cannot generate ``model``'s traces (a line), or None: it runs a model whose weights are
    all on one CUDA device; a model on the CPU, spread by a device map, or partitioned by ZeRO-3 generates
    through transformers."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "ZeRO-3 partitions the weights"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return f"the weights are spread over {len(devices)} devices (a device map)"
    if next(iter(devices)).type != "cuda":
        return f"the model is on the {next(iter(devices)).type.upper()}"
    return None


def generate_traces(model, tokenizer, prompts: list[str], max_new_tokens: int, sample: bool = False,
                    temperature: float = 0.6, top_p: float = 0.95, seed: int = 0, batch_size: int = 8,
                    cache: bool = True, progress: bool = True, engine: str = "auto") -> list[list[int]]:
    """One trace per prompt: the chat-formatted prompt's ids and the model's answer, ended by its EOS token (at
    least one answer token: an EOS first is not taken).

    ``engine``: ``"auto"`` generates on rolecall's engine (:func:`rolecall.runtime.engine.generate`: static cache, CUDA
    graphs, all prompts in as few batches as the GPU's free memory holds) when :func:`engine_refusal` finds
    nothing in the way, else through transformers ``model.generate`` (``batch_size`` prompts at a time, left
    padded), saying why in one line; ``"engine"`` or ``"transformers"`` take that path. Greedy traces are the
    same either way (the engine matches ``model.generate`` token for token; the cache key is the same); sampled
    ones are drawn by each path's own generator, so the engine's are cached under a key of their own.
    """
    from rolecall.data.reasoning import format_prompt

    if not prompts:
        raise TraceError("no calibration prompts; pass --prompts with a source that has some")
    if engine not in ("auto", "engine", "transformers"):
        raise TraceError(f"engine must be 'auto', 'engine' or 'transformers', got {engine!r}")
    why = engine_refusal(model) if engine == "auto" else None
    on_engine = engine == "engine" or (engine == "auto" and why is None)
    settings = {"max_new_tokens": max_new_tokens, "sample": sample, "seed": seed, "batch_size": batch_size,
                **({"temperature": temperature, "top_p": top_p} if sample else {}),
                **({"sampler": "engine"} if sample and on_engine else {})}
    path = trace_cache_path(model, prompts, settings)
    if cache and path.is_file():
        return read_traces(path)
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    encoded = [tokenizer(format_prompt(tokenizer, p), add_special_tokens=False)["input_ids"] for p in prompts]
    gen = dict(max_new_tokens=max_new_tokens, sample=sample, temperature=temperature, top_p=top_p, seed=seed,
               eos=eos, pad=pad, progress=progress)
    if on_engine:
        traces = _on_engine(model, encoded, **gen)
        first_eos = [i for i, t in enumerate(traces) if len(t) == len(encoded[i]) + 1 and t[-1] in eos]
        if first_eos:  # what min_new_tokens=1 forbids: those prompts again through transformers (rare)
            redone = _on_transformers(model, [encoded[i] for i in first_eos], batch_size=batch_size, **gen)
            for i, trace in zip(first_eos, redone):
                traces[i] = trace
    else:
        if engine == "auto" and progress:
            print(f"generating traces through transformers: {why}", file=sys.stderr)
        traces = _on_transformers(model, encoded, batch_size=batch_size, **gen)
    if cache:
        write_traces(path, traces)
    return traces


def _answer(prompt_ids: list[int], row: list[int], eos: set[int]) -> list[int]:
    """The trace: the prompt, then the answer up to and with its first EOS."""
    answer = []
    for t in row:
        answer.append(t)
        if t in eos:
            break
    return prompt_ids + answer


def _on_transformers(model, encoded: list[list[int]], *, max_new_tokens: int, sample: bool, temperature: float,
                     top_p: float, seed: int, eos: set[int], pad: int, progress: bool,
                     batch_size: int) -> list[list[int]]:
    """``model.generate``, ``batch_size`` left-padded prompts at a time; a bar of decoding steps."""
    from tqdm.auto import tqdm
    from transformers import LogitsProcessorList

    device = model.get_input_embeddings().weight.device
    generator_seed = torch.Generator().manual_seed(seed)
    traces = []
    batches = -(-len(encoded) // batch_size)
    bar = tqdm(total=batches * max_new_tokens, desc=f"generating {len(encoded)} traces", unit="step",
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
        traces.extend(_answer(p, row, eos) for p, row in zip(batch, out[:, width:].tolist()))
        bar.n = (i // batch_size + 1) * max_new_tokens  # a batch that stopped early at EOS
        bar.refresh()
    bar.close()
    return traces


class _TokenBar:
    """A streamer for :func:`rolecall.runtime.engine.generate` that advances a bar of generated tokens: the batch's rows
    times the steps its first row has taken (the first call is the prompt)."""

    def __init__(self, bar, rows: int) -> None:
        self.bar, self.rows, self.prompt_seen = bar, rows, False

    def put(self, ids) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.bar.update(self.rows * len(ids))

    def end(self) -> None:
        pass


def engine_rows(model, longest: int, max_new_tokens: int, prompts: int, device) -> int:
    """Rows per engine batch: all ``prompts`` where the GPU's free memory holds their cache (``longest`` prompt
    plus ``max_new_tokens`` a row, with a fifth of the memory left for the rest), else as many as it holds; all of
    them off the GPU."""
    if device.type != "cuda":
        return prompts
    from rolecall.runtime.engine import ModelShape, StaticCache

    shape = ModelShape.from_config(model.config)
    per_row = StaticCache.bytes_needed(shape, 1, longest + max_new_tokens)
    free = torch.cuda.mem_get_info(device)[0]
    return max(1, min(prompts, int(0.8 * free // max(per_row, 1))))


def _on_engine(model, encoded: list[list[int]], *, max_new_tokens: int, sample: bool, temperature: float,
               top_p: float, seed: int, eos: set[int], pad: int, progress: bool) -> list[list[int]]:
    """:func:`rolecall.runtime.engine.generate` with full attention, in batches of :func:`engine_rows`; a bar of tokens
    that finishes at the total."""
    from tqdm.auto import tqdm

    from rolecall.runtime.engine import Sampling, generate, shared_weights
    from rolecall.runtime.session import bound_policy

    device = model.get_input_embeddings().weight.device
    policy = bound_policy("full", None, model.config)
    rows = engine_rows(model, max(map(len, encoded)), max_new_tokens, len(encoded), device)
    total = len(encoded) * max_new_tokens
    bar = tqdm(total=total, desc=f"generating {len(encoded)} traces on the engine", unit="tok", disable=not progress)
    traces = []
    with shared_weights(model) as weights:
        for k, i in enumerate(range(0, len(encoded), rows)):
            batch = encoded[i : i + rows]
            sampling = Sampling(do_sample=sample, temperature=temperature, top_p=top_p, seed=(seed + k) % 2**32)
            done_before = bar.n
            out = generate(weights, policy, batch, max_new_tokens=max_new_tokens, sampling=sampling,
                           eos_token_id=sorted(eos), pad_token_id=pad, streamer=_TokenBar(bar, len(batch)))
            traces.extend(p + tokens for p, tokens in zip(batch, out.tokens))
            bar.n = done_before + len(batch) * max_new_tokens  # rows that ended at EOS count their full share
            bar.refresh()
    bar.close()
    return traces
