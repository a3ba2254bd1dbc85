"""What every builder shares: token pieces with a label flag, chat-template splicing, the on-disk cache and
the ``TokenDataset`` that the trainer and the calibrator consume.

A sample is assembled from *pieces*: lists of token ids, each either labelled (its ids become the targets)
or not (−100). Pieces are tokenised one by one, so a haystack cut on token boundaries stays exactly as cut
and every label span is known without searching the token stream afterwards.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from rolecall.core.atomic import atomic_write

IGNORE = -100
CACHE_FORMAT = "1"  # bump when the layout of cached samples changes


@dataclass(frozen=True)
class Piece:
    """A run of token ids; ``label`` marks the ids that are training targets."""

    ids: tuple[int, ...]
    label: bool = False


def encode(tokenizer, text: str) -> tuple[int, ...]:
    """Token ids of ``text`` without any special tokens added by the tokenizer."""
    return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()


def text_piece(tokenizer, text: str, label: bool = False) -> Piece:
    return Piece(encode(tokenizer, text), label)


def prefix_ids(tokenizer) -> tuple[int, ...]:
    """The ids a tokenizer puts in front of every text (``[bos]`` for Llama, nothing for GPT-2-style ones);
    ids it appends (an EOS) are left out: a prompt goes on after its text."""
    ids = tokenizer.encode("x", add_special_tokens=True)
    bare = tokenizer.encode("x", add_special_tokens=False)
    for i in range(len(ids) - len(bare) + 1):
        if ids[i:i + len(bare)] == bare:
            return tuple(ids[:i])
    return ()


def assemble(pieces: Iterable[Piece]) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Concatenate pieces into ``input_ids`` and ``labels`` (1-D LongTensors) and the ``[start, end)`` token
    span of each labelled piece."""
    ids: list[int] = []
    labels: list[int] = []
    spans: list[tuple[int, int]] = []
    for p in pieces:
        if p.label:
            spans.append((len(ids), len(ids) + len(p.ids)))
        ids.extend(p.ids)
        labels.extend(p.ids if p.label else [IGNORE] * len(p.ids))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long), spans


_SENTINEL = "\x1e{}\x1e"
_SENTINEL_RE = re.compile("\x1e(\\d+)\x1e")


def pad_collate(samples: Sequence[dict[str, Any]], pad_id: int = 0) -> dict[str, Any]:
    """Batch samples for a DataLoader: ``input_ids`` right-padded with ``pad_id``, ``labels`` with −100, an
    ``attention_mask``; any other field becomes a list with one entry per sample."""
    if not samples:
        raise ValueError("pad_collate needs at least one sample")
    width = max(len(s["input_ids"]) for s in samples)
    batch: dict[str, Any] = {
        "input_ids": torch.full((len(samples), width), pad_id, dtype=torch.long),
        "labels": torch.full((len(samples), width), IGNORE, dtype=torch.long),
        "attention_mask": torch.zeros((len(samples), width), dtype=torch.long),
    }
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        batch["input_ids"][row, :n] = s["input_ids"]
        batch["labels"][row, :n] = s["labels"]
        batch["attention_mask"][row, :n] = 1
    for key in samples[0]:
        if key not in batch:
            batch[key] = [s.get(key) for s in samples]
    return batch


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_pieces(tokenizer, turns: Sequence[tuple[str, list[Piece]]]) -> list[Piece]:
    """Wrap ``turns`` (role, pieces) in the tokenizer's chat template.

    The template is rendered with a placeholder per turn; the literal template text between placeholders is
    tokenised on its own and the turns' pieces are spliced in unchanged, so labels and haystack token
    boundaries survive the template.
    """
    if not has_chat_template(tokenizer):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                         "build without chat_template=True")
    messages = [{"role": role, "content": _SENTINEL.format(i)} for i, (role, _) in enumerate(turns)]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    out: list[Piece] = []
    seen = []
    pos = 0
    for m in _SENTINEL_RE.finditer(rendered):
        out.append(text_piece(tokenizer, rendered[pos:m.start()]))
        k = int(m.group(1))
        seen.append(k)
        out.extend(turns[k][1])
        pos = m.end()
    out.append(text_piece(tokenizer, rendered[pos:]))
    if seen != list(range(len(turns))):
        raise ValueError("the tokenizer's chat template dropped or reordered messages; build without chat_template")
    return [p for p in out if p.ids]


def plain_pieces(tokenizer, pieces: list[Piece]) -> list[Piece]:
    """Pieces of a prompt without chat template: the tokenizer's usual prefix (BOS), then the pieces."""
    return [Piece(prefix_ids(tokenizer)), *pieces]


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash that changes whenever tokenisation or the chat template could change."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    h.update(repr(prefix_ids(tokenizer)).encode())
    return h.hexdigest()[:16]


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def cache_root() -> Path:
    from rolecall.core.models import cache_dir

    return cache_dir() / "data"


def cache_key(kind: str, settings: dict[str, Any]) -> str:
    blob = json.dumps({"format": CACHE_FORMAT, **settings}, sort_keys=True, default=str)
    return f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"


def atomic_torch_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


class TokenDataset(Dataset):
    """A list of samples (dicts whose ``input_ids`` and ``labels`` are 1-D LongTensors, plus per-sample
    metadata) and ``info``: what it was built from, including the cache key, for manifests and logs."""

    def __init__(self, samples: list[dict[str, Any]], info: dict[str, Any]):
        self.samples = samples
        self.info = info

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.samples[i]

    def __repr__(self) -> str:
        return f"TokenDataset({self.info.get('kind')}, {len(self)} samples, key={self.info.get('key')})"

    def describe(self) -> str:
        """One JSON line for a manifest's ``data`` metadata."""
        return json.dumps(self.info, sort_keys=True, default=str)

    def subset(self, keep: Iterable[int], **info: Any) -> TokenDataset:
        return TokenDataset([self.samples[i] for i in keep], {**self.info, **info})

    def save(self, path: Path) -> None:
        atomic_torch_save({"format": CACHE_FORMAT, "info": self.info, "samples": self.samples}, path)

    @classmethod
    def load(cls, path: Path) -> TokenDataset:
        blob = torch.load(path, weights_only=True)
        if blob.get("format") != CACHE_FORMAT:
            raise ValueError(f"{path}: cached dataset format {blob.get('format')!r}, expected {CACHE_FORMAT}; delete it")
        return cls(blob["samples"], blob["info"])


def cached(kind: str, settings: dict[str, Any], build: Callable[[], list[dict[str, Any]]],
           use_cache: bool = True) -> TokenDataset:
    """Load the dataset that ``settings`` identify from the cache, or build it and store it there."""
    key = cache_key(kind, settings)
    path = cache_root() / f"{key}.pt"
    if use_cache and path.is_file():
        try:
            return TokenDataset.load(path)
        except Exception:  # a truncated or foreign file: rebuild rather than fail
            pass
    dataset = TokenDataset(build(), {"kind": kind, "key": key, **settings})
    if use_cache:
        dataset.save(path)
    return dataset
