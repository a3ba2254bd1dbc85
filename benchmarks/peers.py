"""The peer the benchmarks time rolecall against in the same run: FlashInfer's paged decode.

``flashinfer_decode`` builds FlashInfer's batch decode over a ``[B, Hkv, T, D]`` cache read in place: each
(sequence, KV head) is one request with one KV head whose pages are ``page``-token slices of its row (HND layout),
planned once for a page table (every page: dense; only the chosen pages: sparse, as DELTA's and Quest's engines
run it). Tensor cores on, as GQA decode wants them (1.5× slower without), and CUDA-graph buffers, so calls can be
captured. ``benchmarks/kernels.py`` times the call alone; ``benchmarks/decode.py --policies full,full-flashinfer``
times the engine's whole dense step with FlashInfer's call as each layer's attention (:class:`FlashInferFull`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rolecall.runtime.policies.full import FullStep

WORKSPACE_BYTES = 256 << 20  # FlashInfer's scratch for the split-K partials


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def flashinfer_version() -> str:
    import flashinfer

    return flashinfer.__version__


def flashinfer_decode(table: torch.Tensor, tokens: int, groups: int, head_dim: int, page: int, dtype: torch.dtype,
                      scale: float | None = None, workspace: torch.Tensor | None = None) -> Callable[..., torch.Tensor]:
    """``run(q, k, v) -> [B, Hq, D]``: FlashInfer's decode of ``q [B, Hq, D]`` over ``k, v [B, Hkv, T, D]``
    (``T`` a multiple of ``page``), request ``r = b · Hkv + h`` reading the pages ``table[r]`` (ids within its
    row) of which the last holds ``tokens - (n - 1) · page`` valid tokens (a dense table's valid tokens; a sparse
    table's last page is whole), logits scaled by ``scale`` (None: 1/√D). Planned at the first call, which must
    come before any capture; then it can be called in a CUDA graph."""
    import flashinfer

    rows, n = table.shape
    device = table.device
    indptr = torch.arange(rows + 1, device=device, dtype=torch.int32) * n
    last = torch.full((rows,), tokens - (n - 1) * page, dtype=torch.int32, device=device)
    planned: list[Any] = []

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, hkv, t, d = k.shape
        if not planned:
            if t % page or b * hkv != rows or d != head_dim:
                raise ValueError(f"cache [B={b}, Hkv={hkv}, T={t}, D={d}] does not fit {rows} requests of "
                                 f"{page}-token pages of head dim {head_dim}")
            row_start = torch.arange(rows, device=device, dtype=torch.int32)[:, None] * (t // page)
            indices = (row_start + table.to(torch.int32)).flatten().contiguous()
            scratch = workspace if workspace is not None else torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                                         device=device)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                scratch, "HND", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
            wrapper.plan(indptr, indices, last, groups, 1, head_dim, page, q_data_type=dtype, kv_data_type=dtype,
                         sm_scale=scale)
            planned.append(wrapper)
        out = planned[0].run(q.reshape(rows, groups, d), (k.view(-1, 1, page, d), v.view(-1, 1, page, d)))
        return out.view(b, hkv * groups, d)

    return run


@dataclass
class FlashInferFull:
    """``full`` whose every layer attends through FlashInfer's dense paged decode instead of rolecall's kernel:
    the engine's dense step built on the peer (benchmarks only; the weights, projections, norms and the rest of
    the step are the engine's). FlashInfer is planned once, at the step's first call (before the capture), for the
    tokens the cache holds then, and every layer shares that plan; each timed step adds a token that it does not
    read (at most ``--warmup`` + ``--steps`` + a few tokens fewer than rolecall's kernel reads: 0.03 % of 128K)."""

    name: ClassVar[str] = "full-flashinfer"
    page: int = 64

    def bind(self, manifest: Any, config: Any) -> None:
        """Any manifest (or none): full attention ignores roles."""

    def static_step(self, shape: Any) -> FlashInferStep:
        if any(w is not None for w in shape.windows or ()):
            raise ValueError("full-flashinfer times models without sliding-window layers")
        return FlashInferStep(self.page)


@dataclass
class FlashInferStep(FullStep):
    page: int = 64
    run: Callable[..., torch.Tensor] | None = field(default=None, repr=False)  # planned at the first call

    def attention(self, dec: Any, layer: int, q, k, v, span, state: dict) -> Any:
        if self.run is None:
            rows = k.shape[0] * k.shape[1]
            tokens = int(span.last) + 1  # a host read: the first call runs before the capture
            table = torch.arange(-(-tokens // self.page), device=k.device).expand(rows, -1)
            self.run = flashinfer_decode(table, tokens, q.shape[1] // k.shape[1], k.shape[3], self.page, k.dtype,
                                         dec.shape.attention_scale)
        return self.run(q, k, v)
