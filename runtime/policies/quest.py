"""``quest``: Quest (Tang et al. 2024, "Query-aware sparsity for long-context LLM inference"), a baseline
that needs no manifest.

Every page of ``page_size`` cache slots keeps the elementwise minimum and maximum of its keys. At each decode
step every layer from ``dense_layers`` on scores each page, per query head, by the upper bound

    U[u] = scale · Σ_d max(q_d · kmin_d, q_d · kmax_d)  ≥  scale · q · k_t   for every token t in page u,

and each KV head reads its ``K - 1`` pages of highest bound plus the current (last, possibly partial) page,
``K = ceil(budget / page_size)``. Layers ``[0, dense_layers)`` read everything (Quest keeps the first two
layers dense: their attention is too flat for a bound to rank pages).

GQA (Quest itself is multi-head): the query heads of a group share one read set, so the group's page score
is ``group="max"`` (default) the largest bound over its heads — a page is kept if any head could find a
high logit in it, which bounds ``max_{g, t in u} s_g[t]`` — or ``group="sum"`` the sum of the bounds, which
bounds ``Σ_g s_g[t]`` and favours pages several heads want.

Page metadata (in the cache's dtype) is kept per layer in the request's ``scratch``: pages that were already
full are reused and only the pages from the first unfinished one on are computed from the keys, so a step
reads O(page_size · D) keys per head instead of O(T · D) (the bounds themselves still read every page's
metadata, 2/P of the keys). Slots that the query may not read (left padding) are left out of the minimum and
maximum; a page with none counts as empty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rolecall.runtime.kernels.page_bounds import naive as bounds_naive
from rolecall.runtime.kernels.page_bounds import page_bounds, page_minmax
from rolecall.runtime.kernels.page_bounds.naive import NEW_PAGE
from rolecall.runtime.kernels.page_scores import pool_pages
from rolecall.runtime.kernels.topk_select import topk_with_recent
from rolecall.runtime.policies import Plan, PolicyError, Step, mean_tokens_read, positive

GROUPS = ("max", "sum")


@dataclass
class Quest:
    budget: int = 1024  # tokens per KV head, the current page included
    page_size: int = 16  # P
    dense_layers: int = 2  # layers [0, dense_layers) read everything
    group: str = "max"  # how a GQA group's query heads combine their page bounds: "max" or "sum"
    name: ClassVar[str] = "quest"

    def __post_init__(self) -> None:
        for key in ("budget", "page_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise PolicyError(f"policy 'quest': {key} must be a positive integer, got {value!r}")
        positive("dense_layers", self.dense_layers, allow_zero=True, policy=self.name)
        if self.group not in GROUPS:
            raise PolicyError(f"policy 'quest': group must be one of {', '.join(GROUPS)}, got {self.group!r}")
        self.num_pages = math.ceil(self.budget / self.page_size)  # K

    def bind(self, manifest: Any, config: Any) -> None:
        """Any manifest (or none) is fine: Quest decides every step from the keys alone."""

    def bounds(self, step: Step) -> torch.Tensor:
        """Page bounds ``[B, Hq, n]`` for this step, from metadata kept across steps in ``step.scratch``.

        Pages that were full at an earlier step are read from a per-layer buffer (grown by doubling, so steps
        rarely copy it); only the pages from the first one not yet stored are computed from the keys."""
        b, hkv, t, d = step.key.shape
        p = self.page_size
        slot = f"quest.pages.{step.layer}"
        held = step.scratch.get(slot)  # (kmin [B, Hkv, capacity, D], kmax, count of full pages stored)
        full = t // p
        if held is None or held[0].shape[:2] != (b, hkv) or held[2] > full:
            held = (step.key.new_empty(b, hkv, 0, d), step.key.new_empty(b, hkv, 0, d), 0)
        lo, hi, count = held
        new_min, new_max = page_minmax(step.key[:, :, count * p:], step.keep[:, count * p:], p)
        grown = full - count  # pages that are full now and not stored yet
        if grown:
            if full > lo.shape[2]:
                capacity = max(2 * lo.shape[2], full, 16)
                lo = torch.cat([lo[:, :, :count], lo.new_empty(b, hkv, capacity - count, d)], dim=2)
                hi = torch.cat([hi[:, :, :count], hi.new_empty(b, hkv, capacity - count, d)], dim=2)
            lo[:, :, count:full] = new_min[:, :, :grown]
            hi[:, :, count:full] = new_max[:, :, :grown]
        step.scratch[slot] = (lo, hi, full)
        stored = page_bounds(step.query, lo[:, :, :count], hi[:, :, :count], step.scale)
        return torch.cat([stored, page_bounds(step.query, new_min, new_max, step.scale)], dim=-1)

    def plan(self, step: Step) -> Plan:
        if step.layer < self.dense_layers:
            return Plan()
        b, hkv = step.key.shape[:2]
        bounds = self.bounds(step).view(b, hkv, step.groups, -1)  # [B, Hkv, G, n]
        scores = bounds.amax(2) if self.group == "max" else bounds.sum(2)  # [B, Hkv, n]
        valid = pool_pages(step.keep.float(), self.page_size)[:, None, :].expand_as(scores) > 0
        pages = topk_with_recent(scores, self.num_pages, 1, valid)  # [B, Hkv, min(K, n)]
        return Plan(indices=pages, block_size=self.page_size)

    def static_step(self, shape: Any) -> QuestStep:
        return QuestStep(self.page_size, self.num_pages, self.dense_layers, self.group)


@dataclass
class QuestStep:
    """The engine's step. Page minima and maxima live in buffers beside the cache (``prepare``), filled from
    its valid slots whenever the engine sets its length (``after_fill``: after a prefill); each step
    recomputes only the page its new token falls in, from the cache itself, so the metadata is a function of
    the cache (a CUDA-graph warm-up that writes and restores slots leaves nothing stale). Below the crossover
    the engine runs the full step, which keeps no metadata; the first Quest step after it rebuilds every page
    (``after_fill``, once)."""

    page_size: int
    num_pages: int
    dense_layers: int
    group: str
    head_order: ClassVar[None] = None
    sparse: ClassVar[bool] = True
    row_lengths: ClassVar[bool] = True  # its page bounds follow each row's own slots (after_fill, update_page)
    paged: ClassVar[bool] = True  # its bounds read the cache through the span's table (read_span, update_page)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return (self.page_size,)

    def reads(self, shape: Any, context: int) -> float:
        full = [1.0 if i < self.dense_layers else 0.0 for i in range(shape.layers)]
        return mean_tokens_read(shape, context, self.num_pages * self.page_size, full)

    def __post_init__(self) -> None:
        self.meta = PageMeta(self.page_size)

    def prepare(self, dec: Any) -> None:
        # a hybrid model's sliding layers (the cache's rings) run their own attention, not this step
        self.meta.prepare(dec, [i for i in range(self.dense_layers, dec.cache.shape.layers) if i not in dec.cache.rings])

    def after_fill(self, dec: Any, row: int | None = None) -> None:
        self.meta.after_fill(dec, row)

    def attention(self, dec: Any, layer: int, q, k, v, span, state: dict) -> Any:
        if layer < self.dense_layers or layer not in self.meta.kmin:
            return dec.attn.attend(q, k, v, span)
        p = self.page_size
        kmin, kmax = self.meta.update(dec, layer, k, span)
        scores = self.meta.impl(dec).page_scores(q, kmin, kmax, dec.shape.attention_scale, self.group)
        if dec.shape.windows[layer] is not None:  # a window on every layer (Mistral): pages it left are not read
            starts = torch.arange(scores.shape[-1], device=q.device) * p
            last = span.last[:, None] if span.last.dim() else span.last  # each row's own, on the scheduler's rows
            readable = (starts + p - 1 >= span.first[:, None]) & (starts <= last)  # [B, n]: overlaps the span
            scores = scores.masked_fill(~readable[:, None, :], -math.inf)
        pages = dec.attn.select(scores, p, self.num_pages, 1)
        return dec.attn.attend(q, k, v, span, pages, p)


class PageMeta:
    """Per-layer page minima and maxima beside the engine's cache, for the layers given to ``prepare``: filled from
    the valid slots whenever the engine sets its length (``after_fill``), and each step only the page of the new
    token is recomputed from the cache (``update``), so they are a function of the cache. Quest's step and
    DELTA's refining step keep theirs here."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.kmin: dict[int, torch.Tensor] = {}
        self.kmax: dict[int, torch.Tensor] = {}

    @staticmethod
    def impl(dec: Any) -> Any:
        """The page-bound kernels the decoder runs: Triton's, or the references."""
        if dec.triton:
            from rolecall.runtime.kernels.page_bounds import triton

            return triton
        return bounds_naive

    def prepare(self, dec: Any, layers: Any) -> None:
        c, n = dec.cache, math.ceil(dec.cache.slots / self.page_size)
        shape = (c.batch, c.shape.kv_heads, n, c.shape.head_dim)
        self.kmin = {i: torch.full(shape, math.inf, dtype=c.k[i].dtype, device=c.k[i].device) for i in layers}
        self.kmax = {i: torch.full_like(t, -math.inf) for i, t in self.kmin.items()}

    def after_fill(self, dec: Any, row: int | None = None) -> None:
        """The bounds of the filled pages; the pages after them empty again (a reused decoder's last request
        filled them). ``row``: only that row of the scheduler's took a new request, and only its bounds are built,
        from its own slots (its length in the cache). Without it, rows of their own lengths are bounded up to the
        longest: a shorter row's pages past its new token's are never scored (:meth:`DecodeAttention.select` ranks a
        row's pages up to its own), and the page of its new token is recomputed from its valid slots before it is
        (``update``)."""
        c, p = dec.cache, self.page_size
        rows = slice(None) if row is None else slice(row, row + 1)
        if row is not None:
            length = int(c.length[row])
        else:
            length = int(c.length.max()) if c.row_lengths else dec.position
        keep = torch.arange(length, device=c.length.device)[None, :] >= c.pads[rows, None]  # [B, T]
        cache = c if row is None else c.row(row)
        for i in self.kmin:
            lo, hi = page_minmax(cache.read_span(i, length)[0], keep, p)
            n = lo.shape[2]
            self.kmin[i][rows, :, :n], self.kmax[i][rows, :, :n] = lo, hi
            self.kmin[i][rows, :, n:], self.kmax[i][rows, :, n:] = math.inf, -math.inf

    def update(self, dec: Any, layer: int, k: torch.Tensor, span: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Recompute the new token's page of ``layer`` from the cache ``k``; its ``(kmin, kmax)`` buffers."""
        self.impl(dec).update_page(kmin=self.kmin[layer], kmax=self.kmax[layer],
                                   **dict(zip(NEW_PAGE, self.new_page(k, span))))
        return self.kmin[layer], self.kmax[layer]

    def new_page(self, k: torch.Tensor, span: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, Any]:
        """What :func:`~rolecall.runtime.kernels.page_bounds.update_page` reads besides the buffers (keys, first and last
        readable slot, page size, a paged cache's block table; :data:`NEW_PAGE`): for a kernel that updates the new
        token's page itself."""
        return k, span.first, span.last, self.page_size, span.table
