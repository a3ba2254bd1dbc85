"""GPU kernels, each in its own folder beside its PyTorch reference (see the README's *GPU kernels* section)."""

from __future__ import annotations

import importlib.util
import os

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


__all__ = ["sm_count", "use_triton"]
