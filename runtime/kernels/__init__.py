"""GPU kernels, each in its own folder beside its PyTorch reference (see the README's *GPU kernels* section)."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

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


@functools.cache
def _triton_max_shared(index: int) -> int:
    from triton.runtime.driver import driver

    return driver.active.utils.get_device_properties(index)["max_shared_mem"]


def op_or(name: str, plain: Callable) -> Callable:
    """``torch.ops.rolecall.<name>`` while torch.compile traces (the custom op: one opaque call in its graph), else
    ``plain``, the function that op runs. The op's dispatch costs host time at every call (an H100's host: 85 µs a
    call of the add-and-norm through its op, 28 µs for the bare launch), which a replayed CUDA graph never pays and
    an eager pass pays at each call: the prefill of a short prompt (at most 64 rows in all) runs most of its
    projections on the kernels (SmolLM2-135M at 48 rows: q/k/v, o and down, 90 calls)."""
    return getattr(torch.ops.rolecall, name) if torch.compiler.is_compiling() else plain


__all__ = ["max_shared", "op_or", "sm_count", "use_triton"]
