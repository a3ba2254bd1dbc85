"""The memory plan of a served model: how the device's memory splits into weights, activations and a KV pool,
computed from a config alone (no GPU, no weights), before anything loads.

KV is counted in pages of :data:`PAGE_TOKENS` tokens, the page DELTA and Quest select, per layer: a request of
``n`` tokens holds ``ceil(n / 16)`` pages in a full-attention layer, the pages its window reaches in a
sliding-window layer of a hybrid model (Gemma 3), and in a layer whose policy evicts (Lethe) the pages of the
tokens it keeps (:func:`rolecall.runtime.policies.base.tokens_held`). A page of one layer costs
``2 × kv_heads × head_dim × 16 × element`` bytes, so :attr:`MemoryPlan.kv_bytes_per_token` of a dense model is
the closed form ``2 × layers × kv_heads × head_dim × element`` (DS-R1-Distill-Qwen-14B in bf16: 196,608).

The pool is what is left of ``utilization × device memory`` after the weights and the activation peak
(:func:`activation_bytes`, an upper estimate of a prefill chunk's transient tensors plus, on a GPU, the CUDA
context and graphs), or exactly ``kv_cache_bytes`` when the user sets it. ``max_concurrency`` is how many
requests of ``max_context`` tokens the pool holds at once; a plan with none is refused (:meth:`refusal`) before
a weight loads.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the plan needs no torch: `rolecall plan --help` and the flags' checks stay light
    from rolecall.runtime.engine.shape import ModelShape

PAGE_TOKENS = 16  # tokens of a KV page: the page DELTA and Quest select
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}  # bytes of a weight or KV element, by --dtype
GIB = 2 ** 30
CUDA_OVERHEAD = GIB  # the CUDA context, cuBLAS workspaces and captured graphs, outside the activation estimate
DEFAULT_UTILIZATION = 0.9


def pages(tokens: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-int(tokens) // PAGE_TOKENS)


def window_pages(window: int, context: int) -> int:
    """Pages a sliding-window layer holds for a request of ``context`` tokens: those the last ``window`` positions
    touch, which straddle one page boundary more than ``window`` itself fills when they start inside a page."""
    if context <= window:
        return pages(context)
    return min(pages(context), pages(window - 1) + 1)


def layer_pages(shape: ModelShape, context: int, held: list[int] | None = None) -> list[int]:
    """Pages each layer holds for one request of ``context`` tokens: a window's pages on a sliding-window layer of
    a hybrid model, else ``held[l]`` tokens' pages (what the policy keeps; every token when None)."""
    sliding = set(shape.sliding_layers)
    return [window_pages(int(shape.windows[i]), context) if i in sliding
            else pages(context if held is None else min(context, held[i]))
            for i in range(shape.layers)]


def page_bytes(shape: ModelShape, element: int) -> int:
    """Bytes of one layer's page: K and V of 16 tokens for every KV head."""
    return 2 * shape.kv_heads * shape.head_dim * PAGE_TOKENS * element


def held_weight_bytes(shape: ModelShape, element: int) -> int:
    """Bytes of the weights a model of ``shape`` holds: every matrix, norm and bias, and a second vocabulary
    matrix when input and output embeddings are not tied."""
    return shape.weight_bytes(0, element) + (0 if shape.tied else element * shape.vocab * shape.hidden)


def activation_bytes(shape: ModelShape, element: int, rows: int, chunk: int, cuda: bool) -> int:
    """An upper estimate of the transient memory of the engine: one prefill chunk of ``chunk`` tokens through a
    layer (the residual and normed hidden states, q/k/v, the attention output, the MLP's two projections and
    their product) and float32 logits of ``rows`` rows twice (logits and the sampler's copy); on a GPU
    :data:`CUDA_OVERHEAD` more."""
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    per_token = 3 * shape.hidden + qkv + shape.heads * shape.head_dim + 3 * shape.intermediate
    return element * chunk * per_token + 2 * 4 * rows * shape.vocab + (CUDA_OVERHEAD if cuda else 0)


def check_fraction(value: Any, flag: str = "--gpu-memory-utilization") -> float:
    """``value`` as a fraction of the device in (0, 1], or a one-line ``ValueError`` naming it and the fix."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 < value <= 1
    if not ok:
        raise ValueError(f"{flag} {value!r}: give the fraction of the device's memory the server may use, in (0, 1] "
                         f"(default {DEFAULT_UTILIZATION})")
    return float(value)


def check_gib(value: Any, flag: str) -> float:
    """``value`` as a finite number of GiB > 0, or a one-line ``ValueError``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"{flag} {value!r}: give a finite number of GiB greater than 0")
    return float(value)


@dataclass(frozen=True)
class MemoryPlan:
    """How a device's memory holds one served model (all sizes in bytes). ``kv_bytes_per_token``: KV bytes a
    request of ``max_context`` tokens holds per token under ``policy`` (pages rounded up); ``request_bytes`` the
    whole request. ``pool_tokens``: tokens of a full-attention request the pool holds (``pool_pages`` pages of
    every layer); ``max_concurrency``: requests of ``max_context`` tokens it holds at once under ``policy``."""

    model: str
    policy: str
    device: str
    dtype: str
    device_bytes: int
    utilization: float | None
    weight_bytes: int
    activation_bytes: int
    pool_bytes: int
    kv_bytes_per_token: float
    kv_bytes_per_token_full: int
    request_bytes: int
    page_tokens: int
    pool_pages: int
    pool_tokens: int
    max_context: int
    max_concurrency: int

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def refusal(self) -> str | None:
        """One line when the pool cannot hold one request of ``max_context`` tokens (the numbers and the fixes),
        else None."""
        if self.max_concurrency >= 1:
            return None
        fits = self.fitting_context()
        if fits < PAGE_TOKENS and self.utilization is not None:
            return (f"{self.model} does not fit: {self.weight_bytes / GIB:.2f} GiB of weights and "
                    f"{self.activation_bytes / GIB:.2f} GiB of activations leave no KV pool in {self.utilization:g} of "
                    f"{self.device_bytes / GIB:.1f} GiB; use a GPU with more memory, a smaller model or a higher "
                    "--gpu-memory-utilization")
        shorter = f"--max-context {fits} or less" if fits >= PAGE_TOKENS else "a larger --kv-cache-gib"
        return (f"{self.model} with policy {self.policy} cannot hold one request of {self.max_context:,} tokens: it "
                f"needs {self.request_bytes / GIB:.2f} GiB of KV and the pool has {max(self.pool_bytes, 0) / GIB:.2f} "
                f"GiB ({self.pool_source()}); ask for {shorter}, more memory (--gpu-memory-utilization, "
                "--kv-cache-gib, a larger GPU) or a policy that holds less (lethe)")

    def fitting_context(self) -> int:
        """The longest context, in whole pages, that one request of a dense layer set could hold in the pool."""
        per_page = self.kv_bytes_per_token_full * PAGE_TOKENS
        return max(0, self.pool_bytes) // per_page * PAGE_TOKENS if per_page else 0

    def pool_source(self) -> str:
        if self.utilization is None:
            return "--kv-cache-gib"
        return (f"{self.utilization:g} of {self.device_bytes / GIB:.1f} GiB less {self.weight_bytes / GIB:.2f} GiB "
                f"of weights and {self.activation_bytes / GIB:.2f} GiB of activations")

    def lines(self) -> list[str]:
        """The plan as a few lines for a person."""
        return [
            f"model {self.model}, {self.dtype}, on {self.device}",
            f"weights {self.weight_bytes / GIB:.2f} GiB, activation peak ≈ {self.activation_bytes / GIB:.2f} GiB",
            f"KV pool {max(self.pool_bytes, 0) / GIB:.2f} GiB ({self.pool_source()}): {self.pool_pages:,} pages of "
            f"{self.page_tokens} tokens = {self.pool_tokens:,} tokens at {self.kv_bytes_per_token_full:,} bytes a "
            "token in every layer",
            f"policy {self.policy}: {self.kv_bytes_per_token:,.0f} KV bytes a token, {self.request_bytes / GIB:.3f} GiB "
            f"a request of {self.max_context:,} tokens",
            f"maximum concurrency for {self.max_context:,} tokens per request: {self.max_concurrency}",
        ]


def plan_memory(shape: ModelShape, *, max_context: int, element: int, device_bytes: int, cuda: bool,
                held: list[int] | None = None, utilization: float | None = DEFAULT_UTILIZATION,
                kv_cache_bytes: int | None = None, rows: int = 1, chunk: int = 4096, model: str = "",
                policy: str = "full", device: str = "", dtype: str = "") -> MemoryPlan:
    """The plan for ``shape`` in ``element``-byte KV and weights on a device of ``device_bytes``: ``held[l]``
    tokens a request of ``max_context`` keeps in layer ``l`` under the policy (None: every token), the pool from
    ``utilization`` of the device after weights and activations, or ``kv_cache_bytes`` exactly when given."""
    weights = held_weight_bytes(shape, element)
    activations = activation_bytes(shape, element, rows, min(chunk, max_context), cuda)
    if kv_cache_bytes is not None:
        pool, utilization = int(kv_cache_bytes), None
    else:
        pool = int(device_bytes * check_fraction(utilization)) - weights - activations
    per_page = page_bytes(shape, element)
    request = sum(layer_pages(shape, max_context, held)) * per_page
    full_token = per_page * shape.layers // PAGE_TOKENS
    pool_pages = max(pool, 0) // (per_page * shape.layers)
    return MemoryPlan(model=model, policy=policy, device=device, dtype=dtype, device_bytes=int(device_bytes),
                      utilization=utilization, weight_bytes=weights, activation_bytes=activations, pool_bytes=pool,
                      kv_bytes_per_token=request / max_context, kv_bytes_per_token_full=full_token,
                      request_bytes=request, page_tokens=PAGE_TOKENS, pool_pages=pool_pages,
                      pool_tokens=pool_pages * PAGE_TOKENS, max_context=int(max_context),
                      max_concurrency=max(pool, 0) // request if request else 0)


def engine_pages(plan: MemoryPlan, shape: ModelShape, element: int, rows: int) -> int:
    """Pages of the served engine's pool (its layers that are not rings; one page the null page) in ``plan``'s pool
    once ``rows`` rows' rings are set aside: a hybrid model's sliding layers hold a ring of their window beside
    the pool, in every row (:class:`~rolecall.runtime.engine.cache.StaticCache`); 0 when nothing is left."""
    sliding = set(shape.sliding_layers)
    ring_slots = sum(min(int(shape.windows[i]), plan.max_context) + 1 for i in sliding)
    token = 2 * shape.kv_heads * shape.head_dim * element  # K and V of one token in one layer
    left = plan.pool_bytes - rows * ring_slots * token
    paged = shape.layers - len(sliding)
    return max(left, 0) // (page_bytes(shape, element) * paged) if paged else 0


def device_memory(device: str) -> tuple[int, str]:
    """Bytes of memory of ``device`` (``cuda[:N]``: the GPU's; ``cpu``: the machine's RAM) and its name."""
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        return int(props.total_memory), props.name
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "cpu"


__all__ = ["ELEMENT_BYTES", "PAGE_TOKENS", "MemoryPlan", "activation_bytes", "check_fraction", "check_gib", "device_memory",
           "held_weight_bytes", "layer_pages", "pages", "plan_memory", "window_pages"]
