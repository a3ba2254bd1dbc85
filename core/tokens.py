"""Token ids against a model's vocabulary: refused in one line before any model runs on them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class TokenIdError(ValueError):
    """A sequence holds a token id the model has no embedding for (the message names it and the fix)."""


def check_token_ids(sequences: Iterable[Any], vocab_size: int | None, what: str,
                    fix: str = "re-tokenize it with this model's tokenizer") -> None:
    """Refuse the first sequence holding an id outside ``[0, vocab_size)`` before any model runs on it.

    ``sequences``: lists of ints or 1-D tensors. ``vocab_size``: the model's (its text config's ``vocab_size``);
    None checks only that no id is negative (nothing is known of the model yet). ``what``: how to name the n-th
    sequence (1-based), e.g. ``"trace {n} of traces.jsonl"``. The message is one line: which sequence, which id,
    the valid range and ``fix`` — what an embedding lookup would otherwise report as ``IndexError: index out of
    range in self`` deep inside the model.
    """
    for n, seq in enumerate(sequences, 1):
        if (seq.numel() if isinstance(seq, torch.Tensor) else len(seq)) == 0:
            continue
        # Python's min/max on lists: an id too large for int64 is still named, not an overflow error
        low, high = (int(seq.min()), int(seq.max())) if isinstance(seq, torch.Tensor) else (min(seq), max(seq))
        if low < 0:
            bad = low
        elif vocab_size is not None and high >= vocab_size:
            bad = high
        else:
            continue
        where = what.replace("{n}", str(n))  # not str.format: a path may hold braces
        if vocab_size is None:
            raise TokenIdError(f"{where} has token id {bad}, but token ids are never negative; {fix}")
        raise TokenIdError(f"{where} has token id {bad}, the model's vocabulary has {vocab_size} ids "
                           f"(0-{vocab_size - 1}); {fix}")


def vocab_size(config: Any) -> int | None:
    """The number of token ids a model embeds, from its (text) config; None when the config does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return int(size) if size else None
