"""``rolecall serve``: an OpenAI-compatible HTTP server on the engine's scheduler.

==================  ============================================================================
``protocol.py``     request bodies checked, responses and stream chunks built, OpenAI's errors
``app.py``          :func:`create_app`: the FastAPI app on a :class:`~rolecall.runtime.engine.scheduler.Scheduler`
``metrics.py``      ``/metrics`` in Prometheus' text format
``lifetime.py``     :func:`bind` a socket, :func:`serve` on it: uvicorn; SIGTERM drains, then it returns
==================  ============================================================================

``create_app`` and ``serve`` need ``pip install 'rolecall[serve]'`` (FastAPI and uvicorn), imported when first
used; ``protocol`` and ``metrics`` need neither.
"""

from __future__ import annotations

from typing import Any

_LAZY = {"create_app": "rolecall.runtime.server.app", "bind": "rolecall.runtime.server.lifetime", "serve": "rolecall.runtime.server.lifetime"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'rolecall.runtime.server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = ["bind", "create_app", "serve"]
