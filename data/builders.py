"""The dataset builders by name (:data:`BUILDERS`, :func:`build_dataset`) and the check of chosen names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

BUILDERS: dict[str, tuple[str, str]] = {  # name -> (module, function)
    "passkey": ("rolecall.data.passkey", "build_passkey_dataset"),
    "niah": ("rolecall.data.passkey", "build_niah_dataset"),
    "ruler": ("rolecall.data.ruler", "build_ruler_dataset"),
    "hotpotqa": ("rolecall.data.hotpotqa", "build_hotpotqa_dataset"),
    "reasoning": ("rolecall.data.reasoning", "build_reasoning_dataset"),
}


def check_names(kind: str, names, known) -> tuple[str, ...]:
    """``names`` as a tuple when each is one of ``known``; otherwise one line naming the unknown ones and the
    choices (``ValueError``)."""
    names = tuple(names)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown {kind}(s) {', '.join(unknown) or '(none given)'}; choose from: {', '.join(known)}")
    return names


def builder(name: str) -> Callable[..., Any]:
    import importlib

    if name not in BUILDERS:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(BUILDERS)}")
    module, function = BUILDERS[name]
    return getattr(importlib.import_module(module), function)


def build_dataset(name: str, tokenizer, **options: Any):
    """``build_dataset("passkey", tok, lengths=(1000, 4000))`` = ``rolecall.data.passkey.build_passkey_dataset(tok, ...)``."""
    return builder(name)(tokenizer, **options)
