"""Arrival counters: how a kernel lets the last of a row's programs finish the row's work in the same launch.

Each program of a row does its share, stores it, then adds one to the row's counter (an acquire-release atomic,
after a barrier so every thread's stores are counted); the program that reads ``parts − 1`` knows every share is
stored, reads them from L2 and finishes (a choice among candidates, a merge of split-K partials). It then sets
the counter back to zero, so one buffer serves every launch on a stream, and a CUDA graph captures the same
buffer. Each stream has its own: kernels on two streams (the engine's step and the work it puts beside it) may
run at once, and must not count into the same rows. Used by :mod:`rolecall.runtime.kernels.topk_select.triton`,
:mod:`rolecall.runtime.kernels.page_bounds.triton` and :mod:`rolecall.runtime.kernels.skinny_linear.triton`.

Where it does not pay: merging the decode-attention kernel's split-K partials in each row's last program, instead
of a small launch of its own, measured slower at every shape (H200, 32 / 8 heads, bf16, graph-captured: a 10 %
block-sparse layer at 32K × 1 took 22.8 against 11.3 µs, at 128K × 8 119 against 114 µs; dense 128K × 8 0.974
against 0.970 ms): the last program merges its row alone, and every program pays the fence of the atomic.
"""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # kept alive: a CUDA graph captured before a buffer grew still launches on it


def arrival_counters(device: torch.device, rows: int) -> torch.Tensor:
    """``rows`` zeroed int32 counters for launches on the current stream (see the module docstring). Kept from
    the first call; grown when a launch needs more rows (the new buffer zeroed; while a graph is captured that
    zeroing is captured too, and harmless: the counters are zero between launches anyway). An outgrown buffer is
    never freed, so graphs captured on it stay valid."""
    device = torch.device(device)
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < rows:
        if have is not None:
            _OUTGROWN.append(have)
        have = torch.zeros(max(rows, 1024), device=device, dtype=torch.int32)
        _COUNTERS[key] = have
    return have
