"""How the engine uses ``torch.compile``: a bounded number of compilations per function, and the eager function
when compilation fails, never an error.

The decode step's compiled functions see tensors whose leading size is the decoder's row count. The GPU kernels
they call choose a launch from that count in Python (:func:`rolecall.runtime.kernels.skinny_linear.kernel_config`), so a
symbolic size would be guarded per launch choice, and every new batch size could recompile until torch.compile's
recompile limit (8 a function by default) ends the process with ``FailOnRecompileLimitHit``. So the engine compiles
static code for a few row counts only: a decoder's rows are rounded up to one of :data:`ROW_BUCKETS` wherever
requests of many sizes meet one compiled function (:func:`rows_for`), each bucket compiles once, and the calls
run with the recompile limit raised to :data:`COMPILE_LIMIT`, which the buckets stay under. Should a compilation
fail anyway (a limit, an inductor error), :class:`FallsBackToEager` runs the function eagerly from then on, with
one line on stderr: the values are the same, only the speed differs.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

# Row counts a decoder is built with where requests of any batch size arrive (Session.generate): past 8 rows,
# less than half again as many rows as asked.
ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Compilations of one function in this process before it runs eagerly: one per bucket, and as many again for
# decoders of other models or policies in the same process.
COMPILE_LIMIT = 2 * len(ROW_BUCKETS)


def compiles_on(device: Any) -> bool:
    """Whether the engine's step compiles on ``device``: on CUDA unless ``ROLECALL_COMPILE=0``, anywhere with
    ``ROLECALL_COMPILE=1``."""
    flag = os.environ.get("ROLECALL_COMPILE", "")
    return flag == "1" or (torch.device(device).type == "cuda" and flag != "0")


def rows_for(rows: int) -> int:
    """The smallest of :data:`ROW_BUCKETS` that holds ``rows``, or ``rows`` itself past the largest."""
    return next((b for b in ROW_BUCKETS if b >= rows), rows)


def compiled(fn: Any, dynamic: bool | None = False, **options: Any) -> FallsBackToEager:
    """``fn`` through ``torch.compile`` (``fullgraph=True``, inductor ``options``), falling back to ``fn`` when
    compilation fails. ``dynamic=False`` (default): static code for each shape it meets, for functions whose
    launches depend on the row count (see the module's docstring); ``None``: torch.compile's default, symbolic
    sizes from the second shape on, for functions that branch on no size."""
    return FallsBackToEager(fn, torch.compile(fn, dynamic=dynamic, fullgraph=True, options=options or None))


_FAILED: set[Any] = set()  # the code of functions whose compilation failed once in this process


class FallsBackToEager:
    """A compiled function that runs its eager original from the first call whose compilation fails (an error of
    torch.compile's own: inductor's codegen failing for one shape, seen with torch 2.11 on lethe's eviction over
    16,001 slots, or the recompile limit), with one line saying so. The eager function computes the same values,
    so only speed changes; an error of the function itself is raised again by the eager call. The failure is
    remembered for the function's code, so the next decoder does not spend another compilation on it. Calls run
    with torch.compile's recompile limit at :data:`COMPILE_LIMIT` (restored after each call)."""

    def __init__(self, eager: Any, compiled: Any) -> None:
        self.eager, self.compiled = eager, compiled
        target = getattr(eager, "func", eager)  # a functools.partial: its function
        self.code = getattr(getattr(target, "__func__", target), "__code__", target)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.code not in _FAILED:
            try:
                with torch._dynamo.config.patch(recompile_limit=max(COMPILE_LIMIT, _limit()),
                                                fail_on_recompile_limit_hit=True):
                    return self.compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - narrowed below to torch.compile's own errors
                if not compile_error(e):
                    raise
                _FAILED.add(self.code)
                name = getattr(getattr(self.eager, "func", self.eager), "__qualname__", repr(self.eager))
                print(f"rolecall: torch.compile failed on {name} ({type(e).__name__}); running it eagerly",
                      file=sys.stderr)
        return self.eager(*args, **kwargs)


def _limit() -> int:
    return int(torch._dynamo.config.recompile_limit)


def compile_error(e: BaseException) -> bool:
    """Whether ``e`` is torch.compile failing (dynamo, a backend, a recompile limit), not the compiled function
    raising."""
    kinds = []
    for module, name in (("torch._dynamo.exc", "BackendCompilerFailed"), ("torch._dynamo.exc", "Unsupported"),
                         ("torch._dynamo.exc", "FailOnRecompileLimitHit"),
                         ("torch._dynamo.exc", "RecompileLimitExceeded"), ("torch._inductor.exc", "InductorError")):
        try:
            kinds.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            continue
    return isinstance(e, tuple(kinds))


__all__ = ["COMPILE_LIMIT", "ROW_BUCKETS", "FallsBackToEager", "compile_error", "compiled", "compiles_on", "rows_for"]
