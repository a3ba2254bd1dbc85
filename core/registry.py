"""One way to name implementations: policies, Δ-layer selectors, gates, corpora and reasoning sources.

A :class:`Registry` maps a name to an entry: the object itself (registered with ``@REGISTRY.register(name)``
beside its definition) or a ``"module:attr"`` string imported on first use, so that each implementation stays
in its own file and loads only when asked for. :meth:`Registry.lookup` is the one place an unknown name is
refused, in one line that lists the names there are.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class Registry(dict):
    """``name -> entry``; a dict, so ``in``, iteration and ``sorted`` work as on one.

    ``what`` names the kind in the error (``"policy"``), ``error`` is the exception it raises, ``choices``
    replaces the listed names where a name takes arguments (``"pg-essays, booksum[:WHERE], text:PATH"``),
    ``lead`` introduces the list and ``ordered`` keeps the registration order instead of sorting."""

    def __init__(self, what: str, error: type[Exception] = ValueError, choices: str | None = None,
                 lead: str = "choose one of", ordered: bool = False) -> None:
        super().__init__()
        self.what, self.error, self.choices, self.lead, self.ordered = what, error, choices, lead, ordered

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator: register the decorated class or function as ``name``."""

        def wrap(obj: Any) -> Any:
            self[name] = obj
            return obj

        return wrap

    def lookup(self, name: str, shown: str | None = None) -> Any:
        """The entry registered as ``name`` (a ``"module:attr"`` entry imported now); an unknown name raises
        ``error`` naming ``shown`` (default: the name) and the known ones."""
        if name not in self:
            names = self.choices or ", ".join(self if self.ordered else sorted(self))
            raise self.error(f"unknown {self.what} {shown if shown is not None else name!r}; {self.lead} {names}")
        entry = self[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
        return entry
