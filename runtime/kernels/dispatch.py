"""Where a kernel call goes: the Triton kernel or the PyTorch reference (:func:`use_triton`), a plain launch or
the custom op (:func:`kernel_call`, :func:`graphed`), and the GPU figures the kernels size their launches by."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator

import torch

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a call on ``tensor`` goes to a Triton kernel: a CUDA tensor, Triton installed, and the kernels not
    switched off (``ROLECALL_KERNELS=naive`` forces the references everywhere)."""
    return tensor.is_cuda and _HAS_TRITON and os.environ.get("ROLECALL_KERNELS", "auto") != "naive"


def sm_count(tensor: torch.Tensor) -> int:
    """Streaming multiprocessors of ``tensor``'s GPU, which the kernels size their grids by; 8 for a CPU tensor
    (Triton's interpreter)."""
    return torch.cuda.get_device_properties(tensor.device).multi_processor_count if tensor.is_cuda else 8


def max_shared(tensor: torch.Tensor) -> int | None:
    """Bytes of shared memory one program may take on ``tensor``'s GPU (232,448 on an H100, 166,912 on an A100,
    101,376 on sm86 and sm89: RTX 30 and 40 series, A10, A40, L4, L40S), which the kernels choose their tiles by; None
    for a CPU tensor (Triton's interpreter has no limit). Read from torch's device properties, which a compiled
    graph can trace (Triton's driver query cannot); Triton's where torch does not say."""
    if not tensor.is_cuda:
        return None
    optin = getattr(torch.cuda.get_device_properties(tensor.device), "shared_memory_per_block_optin", 0)
    if optin:
        return int(optin)
    index = tensor.device.index
    return _triton_max_shared(index if index is not None else torch.cuda.current_device())


def peak_bandwidth(tensor: torch.Tensor) -> float | None:
    """Bytes a second ``tensor``'s GPU memory moves at its peak, from torch's device properties (memory clock ×
    2 × bus width: 3.35 TB/s on an H100 SXM; an H200 is rated 4.8 TB/s), which a compiled graph can trace; None
    for a CPU tensor or where torch does not say (the kernels then choose their launch by the SMs alone)."""
    if not tensor.is_cuda:
        return None
    props = torch.cuda.get_device_properties(tensor.device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return clock_khz * 1e3 * 2 * bus_bits / 8 if clock_khz and bus_bits else None


@functools.cache
def _triton_max_shared(index: int) -> int:
    from triton.runtime.driver import driver

    return driver.active.utils.get_device_properties(index)["max_shared_mem"]


_GRAPHED: contextvars.ContextVar[bool] = contextvars.ContextVar("rolecall_graphed", default=False)


@contextlib.contextmanager
def graphed() -> Iterator[None]:
    """Marks the calls inside as the warm-up or the capture of a CUDA graph that replays them: they take the
    Triton kernels as plain launches (:func:`kernel_call`), whose host time the replays never pay again. The
    warm-up takes them too, so each kernel is compiled and loaded before the capture."""
    token = _GRAPHED.set(True)
    try:
        yield
    finally:
        _GRAPHED.reset(token)


def kernel_call(name: str, plain: Callable) -> Callable | None:
    """How a wrapper calls its Triton kernel here, or None where it runs its PyTorch reference instead.

    - While torch.compile traces (the decode step's compiled graph): ``torch.ops.rolecall.<name>``, the custom op,
      one opaque call in its graph.
    - Inside :func:`graphed` (a CUDA graph's warm-up and capture): ``plain``, the function that op runs, without the
      op's dispatch.
    - Anywhere else, an eager call (a prefill, an uncaptured step): None. Each eager launch costs host time, and a
      short pass is bound by the host: Triton's launch path costs several times cuBLAS's ``F.linear``. A
      SmolLM2-135M-shaped prefill of one row on an H100 with its projections on the kernels took 36.7 / 23.6 ms at
      40 tokens and 32.6 / 30.7 ms at 48, against 22.1 / 14.5 and 21.1 / 18.8 ms on cuBLAS (two processes, arms
      alternating in each, ``benchmarks/results/prefill_eager_kernels_h100.json``)."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.rolecall, name)
    return plain if _GRAPHED.get() else None


__all__ = ["graphed", "kernel_call", "max_shared", "peak_bandwidth", "sm_count", "use_triton"]
