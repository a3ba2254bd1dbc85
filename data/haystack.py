"""A corpus as one stream of token ids of the target tokenizer, from which haystacks are cut.

Documents are tokenised one at a time and joined by the ids of a blank line, so every cut falls on a token
boundary of the tokenizer that will read the prompt. The stream is capped (``pool_tokens``): a haystack
needs at most tens of thousands of tokens, and BookSum holds far more than any prompt set uses. The stream
is cached under ``cache_dir()/data`` keyed by tokenizer, corpus content and cap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from rolecall.data.corpora import Corpus, CorpusError, load_corpus
from rolecall.data.tokens import atomic_torch_save, cache_key, cache_root, encode, tokenizer_fingerprint

DOC_SEPARATOR = "\n\n"
POOL_TOKENS = 1_000_000


@dataclass
class Haystack:
    """Token stream of a corpus; ``tokens`` is a 1-D int32 tensor."""

    tokens: torch.Tensor
    corpus: str  # the corpus spec
    fingerprint: str  # the corpus content hash

    def __post_init__(self):
        if self.tokens.dim() != 1:
            raise ValueError(f"haystack tokens must be 1-D, got shape {tuple(self.tokens.shape)}")

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def check_length(self, needed: int) -> None:
        if needed > len(self):
            raise CorpusError(f"corpus {self.corpus!r} holds {len(self):,} tokens of this tokenizer, fewer than the "
                              f"{needed:,}-token haystack asked for; use a larger corpus or shorter lengths")

    def cut(self, length: int, rng: np.random.Generator) -> list[int]:
        """``length`` consecutive tokens starting at a random offset."""
        self.check_length(length)
        start = int(rng.integers(0, len(self) - length + 1))
        return self.tokens[start:start + length].tolist()


def load_haystack(tokenizer, source: str | Corpus = "pg-essays", pool_tokens: int = POOL_TOKENS,
                  use_cache: bool = True) -> Haystack:
    """The first ``pool_tokens`` tokens of ``source`` (all of it when shorter) as a :class:`Haystack`."""
    if pool_tokens < 1:
        raise ValueError(f"pool_tokens must be positive, got {pool_tokens}")
    corpus = load_corpus(source)
    fingerprint = corpus.fingerprint()
    key = cache_key("haystack", {"tokenizer": tokenizer_fingerprint(tokenizer), "corpus": fingerprint,
                                 "pool": pool_tokens, "sep": DOC_SEPARATOR})
    path = cache_root() / f"{key}.pt"
    if use_cache and path.is_file():
        try:
            return Haystack(torch.load(path, weights_only=True), corpus.spec, fingerprint)
        except Exception:  # a truncated cache file is rebuilt, not fatal
            pass
    sep = list(encode(tokenizer, DOC_SEPARATOR))
    chunks: list[list[int]] = []
    total = 0
    with tqdm(total=pool_tokens, desc=f"tokenising {corpus.spec}", unit="tok", leave=False) as bar:
        for doc in corpus:
            ids = (sep if chunks else []) + list(encode(tokenizer, doc.text))
            ids = ids[: pool_tokens - total]
            chunks.append(ids)
            total += len(ids)
            bar.update(len(ids))
            if total >= pool_tokens:
                break
        bar.total = total  # a corpus shorter than the pool ends its bar at 100 %, not part-way
        bar.refresh()
    if total == 0:
        raise CorpusError(f"corpus {corpus.spec!r} is empty: it yielded no text; check the path or the field name")
    tokens = torch.tensor([t for c in chunks for t in c], dtype=torch.int32)
    if use_cache:
        atomic_torch_save(tokens, path)
    return Haystack(tokens, corpus.spec, fingerprint)
