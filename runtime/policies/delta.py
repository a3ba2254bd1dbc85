"""``delta``: DELTA (arXiv 2510.09883) layer roles.

* full layers (role 0) read every token;
* Δ-layers (role 1) read every token and choose pages for the layers after them: page score
  ``S[u] = Σ_{t in u} max_h p_h[t]`` (max over all query heads of the layer), the last ``L`` pages always and
  the ``K - L`` other pages of highest score;
* sparse layers (role 2) read only the pages chosen by the nearest earlier Δ-layer in the same step.

Paper defaults: page size P = 16, K = 64 pages (a 1024-token budget), L = 8 recent pages.

``per_head=True`` (not in the paper): a Δ-layer scores pages per KV head (the max over that head's query
group) and chooses K pages for each, so the sparse layers after it read, per KV head, the pages that head's
group wanted, at the same budget per head.

``refine=R > 1`` (not in the paper; two-stage selection): a Δ-layer chooses ``R·K`` candidate pages (its last
``L`` among them), and each sparse layer keeps, per KV head, the ``K`` candidates with the highest Quest bound
``scale · Σ_d max(q_d · kmin_d, q_d · kmax_d)`` of its own query and keys (the max over the head's query
group), the ``L`` recent pages always: DELTA's shared selection narrows the search, each layer's own bound
ranks what is left. On the engine the sparse layers keep page bounds beside the cache, as Quest's step does,
and read only their candidates' metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rolecall.core.manifest import LAYER_ROLE_FULL, LAYER_ROLE_SELECT, LAYER_ROLE_SPARSE
from rolecall.core.models import sliding_layers
from rolecall.runtime.kernels.page_bounds import naive as bounds_naive
from rolecall.runtime.kernels.page_bounds import page_minmax
from rolecall.runtime.kernels.page_scores import attention_probs, head_max_probs, pool_pages
from rolecall.runtime.kernels.topk_select import topk_with_recent
from rolecall.runtime.policies import Plan, PolicyError, Step, mean_tokens_read, positive
from rolecall.runtime.policies.quest import PageMeta


def select_pages(token_scores: torch.Tensor, page_size: int, num_pages: int, recent_pages: int) -> torch.Tensor:
    """``[B, T]`` token scores → ``[B, min(num_pages, ceil(T / page_size))]`` ascending page ids: the last
    ``recent_pages`` pages always, the rest the highest page scores ``Σ_{t in page} token_scores``."""
    for name, value in (("page_size", page_size), ("num_pages", num_pages)):
        if not isinstance(value, int) or value <= 0:
            raise PolicyError(f"select_pages: {name} must be a positive integer, got {value!r}")
    if not isinstance(recent_pages, int) or not 0 <= recent_pages <= num_pages:
        raise PolicyError(f"select_pages: recent_pages must be an integer in [0, num_pages={num_pages}], got {recent_pages!r}")
    return topk_with_recent(pool_pages(token_scores, page_size), num_pages, recent_pages)


DEFAULT_RECENT_PAGES = 8  # the paper's L


@dataclass
class Delta:
    num_pages: int = 64  # K: pages read by sparse layers, recent ones included
    # L, at most K: the pages of the recent context always read (default 8, or K where K is smaller); a value
    # above K is refused, as calibrate-delta refuses it
    recent_pages: int | None = None
    page_size: int = 16  # P
    budget: int | None = None  # tokens; when given, K = ceil(budget / P)
    per_head: bool = False  # Δ-layers choose pages per KV head instead of one set for all heads
    refine: int = 1  # > 1: Δ-layers choose refine·K candidates, each sparse layer the K best by its own bound
    name: ClassVar[str] = "delta"

    def __post_init__(self) -> None:
        positive("page_size", self.page_size, policy=self.name)
        if self.budget is not None:
            positive("budget", self.budget, policy=self.name)
            self.num_pages = math.ceil(self.budget / self.page_size)
        positive("num_pages", self.num_pages, policy=self.name)
        if self.recent_pages is None:
            self.recent_pages = min(DEFAULT_RECENT_PAGES, self.num_pages)
        elif isinstance(self.recent_pages, bool) or not isinstance(self.recent_pages, int) or self.recent_pages < 0:
            raise PolicyError(f"policy 'delta': recent_pages must be a whole number ≥ 0, got {self.recent_pages!r}")
        elif self.recent_pages > self.num_pages:
            given = (f"budget={self.budget} tokens in pages of {self.page_size} gives num_pages={self.num_pages}"
                     if self.budget is not None else f"num_pages is {self.num_pages}")
            raise PolicyError(f"policy 'delta': recent_pages={self.recent_pages} is more than the {self.num_pages} "
                              f"pages read in all ({given}; they count the recent pages too); pass recent_pages ≤ "
                              f"{self.num_pages}, or a larger budget")
        if not isinstance(self.per_head, bool):
            raise PolicyError(f"policy 'delta': per_head must be true or false, got {self.per_head!r}")
        if not isinstance(self.refine, int) or isinstance(self.refine, bool) or self.refine < 1:
            raise PolicyError(f"policy 'delta': refine must be an integer ≥ 1 (1 = off), got {self.refine!r}")
        self.roles: list[int] = []

    def bind(self, manifest: Any, config: Any) -> None:
        if manifest is None or manifest.layer_role is None:
            raise PolicyError(
                "policy 'delta' needs a manifest with a layers section (layers.role); "
                "make one with calibrate-delta, or use policy 'full'"
            )
        self.roles = manifest.layer_role.tolist()
        # Sliding-window layers never reach plan() (the engine runs their own attention), so whatever role a
        # manifest gives them, they neither choose pages nor read them: the nearest earlier Δ-layer of a sparse
        # layer is the nearest earlier non-sliding one.
        sliding = set(sliding_layers(config))
        first_select = next((i for i, r in enumerate(self.roles) if r == LAYER_ROLE_SELECT and i not in sliding),
                            len(self.roles))
        early = [i for i, r in enumerate(self.roles[:first_select]) if r == LAYER_ROLE_SPARSE and i not in sliding]
        if early:
            raise PolicyError(
                f"policy 'delta': sparse layers {early} come before any Δ-layer, so they have no pages to read; "
                "mark an earlier layer as Δ (role 1) or these as full (role 0)"
            )

    def plan(self, step: Step) -> Plan:
        role = self.roles[step.layer]
        if role == LAYER_ROLE_FULL:
            return Plan()
        b, hkv, t = step.key.shape[:3]
        if role == LAYER_ROLE_SELECT:
            if self.per_head:
                probs = attention_probs(step.query, step.key, step.scale, step.keep)  # [B, Hq, T]
                scores = probs.view(b, hkv, step.groups, t).amax(2)  # [B, Hkv, T]
            else:
                scores = head_max_probs(step.query, step.key, step.scale, step.keep)  # [B, T]
            chosen = self.num_pages * self.refine  # candidates when refining, else the pages themselves
            step.scratch["delta.pages"] = select_pages(scores, self.page_size, chosen, self.recent_pages)
            return Plan()
        pages = step.scratch["delta.pages"]  # [B, N] or [B, Hkv, N] from this step's nearest Δ-layer
        if pages.dim() == 2:
            pages = pages[:, None, :].expand(b, hkv, pages.shape[-1])
        if self.refine > 1:
            pages = self.refined(step, pages)
        return Plan(indices=pages, block_size=self.page_size)

    def refined(self, step: Step, candidates: torch.Tensor) -> torch.Tensor:
        """The sparse layer's own choice among the Δ-layer's candidates (``refine_candidates`` of
        :mod:`rolecall.runtime.kernels.page_bounds`), from page metadata computed over every readable key (the
        reference: cost is no concern here)."""
        kmin, kmax = page_minmax(step.key, step.keep, self.page_size)  # [B, Hkv, n, D]
        return bounds_naive.refine_candidates(step.query, kmin, kmax, candidates, step.scale, self.num_pages,
                                              self.recent_pages)

    def static_step(self, shape: Any) -> DeltaStep:
        if len(self.roles) != shape.layers:
            raise PolicyError(f"policy 'delta' holds {len(self.roles)} layer roles for a {shape.layers}-layer model; "
                              "bind it to a manifest of this model first")
        windowed = [i for i, r in enumerate(self.roles) if r == LAYER_ROLE_SPARSE and shape.windows[i] is not None]
        if self.refine > 1 and windowed:  # page bounds kept beside the cache span whole pages, not the window's part
            raise NotImplementedError(f"policy 'delta' with refine > 1 has no engine step for sliding-window sparse "
                                      f"layers ({windowed[:4]}{'…' if len(windowed) > 4 else ''})")
        return DeltaStep(list(self.roles), self.page_size, self.num_pages, self.recent_pages, self.per_head,
                         self.refine)


@dataclass
class DeltaStep:
    """The engine's step: Δ-layers score pages inside their dense attention pass (the Triton kernel keeps the
    logits) and choose on the device; sparse layers read the chosen pages in place."""

    roles: list[int]
    page_size: int
    num_pages: int
    recent_pages: int
    per_head: bool = False
    refine: int = 1
    head_order: ClassVar[None] = None
    sparse: ClassVar[bool] = True
    # rows of their own lengths (the scheduler's): without refining nothing is kept across steps, and refining's
    # page bounds follow each row's own slots (PageMeta)
    row_lengths: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.meta = PageMeta(self.page_size) if self.refine > 1 else None

    paged: ClassVar[bool] = True  # its attention and, refining, its page bounds read through the span's table

    def prepare(self, dec: Any) -> None:
        if self.meta is not None:  # refining: each sparse layer keeps its page bounds beside the cache
            self.meta.prepare(dec, [i for i, r in enumerate(self.roles) if r == LAYER_ROLE_SPARSE])

    def after_fill(self, dec: Any, row: int | None = None) -> None:
        if self.meta is not None:
            self.meta.after_fill(dec, row)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return (self.page_size,)

    def reads(self, shape: Any, context: int) -> float:
        """Mean tokens read per (layer, KV head) at ``context`` tokens (windowed layers read their window)."""
        full = [0.0 if r == LAYER_ROLE_SPARSE else 1.0 for r in self.roles]
        return mean_tokens_read(shape, context, self.num_pages * self.page_size, full)

    def attention(self, dec: Any, layer: int, q, k, v, span, state: dict) -> Any:
        role = self.roles[layer]
        if role == LAYER_ROLE_SELECT:
            chosen = self.num_pages * self.refine  # candidates when refining
            # the choice is made beside the rest of this layer and the next one's projections (a second stream)
            out, state["delta.pages"] = dec.attn.attend_and_choose(q, k, v, span, self.page_size, self.per_head, chosen,
                                                              self.recent_pages)
            return out
        if role == LAYER_ROLE_SPARSE:
            pages = state["delta.pages"].result()  # [B, (Hkv,) N]
            if pages.dim() == 2:
                pages = pages[:, None, :].expand(q.shape[0], k.shape[1], pages.shape[-1])  # no copy
            if self.meta is not None:  # the new token's page metadata, then the choice: one launch on the GPU
                # the Triton program holds a row of candidates as the top-k kernel holds one of scores: the
                # decoder's one rule on row sizes says whether it runs, else the reference does
                impl = self.meta.impl(dec) if dec.attn.triton_topk(pages.shape[-1]) is not None else bounds_naive
                pages = impl.refine_candidates(q, self.meta.kmin[layer], self.meta.kmax[layer], pages,
                                               dec.shape.attention_scale, self.num_pages, self.recent_pages,
                                               new_page=self.meta.new_page(k, span))
            return dec.attn.attend(q, k, v, span, pages, self.page_size)
        return dec.attn.attend(q, k, v, span)
