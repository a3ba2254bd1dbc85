"""Programmatic dependent launch: a kernel may start while the kernel before it on its stream is finishing.

Without it, a kernel's programs start only once the previous kernel has completed and its writes are flushed,
then the new grid is set up: up to a microsecond or so between two launches, which a decode step of hundreds of
kernels pays at each of them. A kernel launched with it (``launch_pdl``) may be scheduled as soon as every program
of the previous kernel has either finished or said it may go (``gdc_launch_dependents``); it must then wait
(``gdc_wait``, which returns once the previous kernel has completed and its writes are visible) before it reads
anything an earlier kernel wrote. Each kernel that takes part calls :func:`wait` first thing in every program, so
the waits chain: the kernel before it has itself completed only after what it waited for. Some say the next kernel
may be placed before they wait (the add-and-norm, the projections): that kernel's programs then wait on the GPU
while this one runs, and start the moment it completes.

NVIDIA Hopper (compute capability 9.0) and later; off on ROCm, under the Triton interpreter and with
``ROLECALL_PDL=0``. A CUDA graph keeps the launches' programmatic edges, so the engine's replayed step uses them.
Measured on an H100 (``docs/performance.md``): a sparse call 0.7–1.4 µs shorter; lychee's
step at 128K × 8 on the DS-Qwen-7B shape 12.18 → 12.08 ms, delta's 9.67 → 9.62, full's unchanged. With the
add-and-norm in the chain (:mod:`rolecall.runtime.kernels.add_rms_norm`) and the projections placing the next kernel at
once, every step measured 0.3–4.5 % faster again (full at 32K × 1 on the 7B shape 6.01 → 5.89 ms).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: the flag below stays off
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def _supported(index: int) -> bool:
    return (gdc_wait is not None and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(index) >= (9, 0))


def enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use programmatic dependent launch (see the module docstring)."""
    if device.type != "cuda" or os.environ.get("ROLECALL_PDL", "1") == "0":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def options(device: torch.device) -> dict:
    """A kernel launch's keywords: its ``PDL`` flag and, when on, ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait(PDL: tl.constexpr):
    """First thing in a program of a kernel launched with ``launch_pdl=PDL``: wait for the previous kernel."""
    if PDL:
        gdc_wait()


@triton.jit
def let_next_start(PDL: tl.constexpr):
    """The next kernel on the stream may be scheduled once every program of this one got here (or finished)."""
    if PDL:
        gdc_launch_dependents()


__all__ = ["enabled", "let_next_start", "options", "wait"]
