"""``lychee``: LycheeDecode head roles.

Retrieval heads (``heads.role == 1``, and every head of layer 0) read every token and choose, per KV head,
the tokens (or blocks) that the same head index reads in the next layer. Sparse heads read the set they
inherit; a sparse head passes it on unchanged, so a chain of sparse heads reuses the last retrieval choice.

The set size follows one of the paper's four strategies (exactly one may be given):

* ``budget`` — a token count (default 1024 when nothing is given);
* ``ratio`` — a fraction of the tokens (blocks) in context (LycheeDecode's best setting);
* ``top_p`` — the smallest set holding at least that attention mass;
* ``threshold`` — every token (block) whose attention share is at least that value.

The score of a token for KV head h is the max over its query heads of the softmax probability; a block's
score is the sum over its tokens. ``recent`` last tokens are always kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rolecall.core.manifest import HEAD_ROLE_RETRIEVAL
from rolecall.core.models import sliding_layers
from rolecall.runtime.kernels.page_scores import attention_probs, pool_pages
from rolecall.runtime.kernels.topk_select import mask_to_indices
from rolecall.runtime.policies import Plan, PolicyError, Step, mean_tokens_read, positive

DEFAULT_BUDGET = 1024


@dataclass
class Lychee:
    budget: int | None = None  # tokens
    ratio: float | None = None  # fraction of the context
    top_p: float | None = None  # attention mass
    threshold: float | None = None  # attention share per token/block
    block_size: int = 1
    recent: int = 1  # last tokens always kept (the current one at least)
    name: ClassVar[str] = "lychee"

    def __post_init__(self) -> None:
        given = [k for k in ("budget", "ratio", "top_p", "threshold") if getattr(self, k) is not None]
        if len(given) > 1:
            raise PolicyError(f"policy 'lychee': give one of budget, ratio, top_p, threshold, not {' and '.join(given)}")
        if not given:
            self.budget = DEFAULT_BUDGET
            given = ["budget"]
        self.mode = given[0]
        positive(self.mode, getattr(self, self.mode), policy=self.name)
        if self.mode in ("ratio", "top_p", "threshold") and getattr(self, self.mode) > 1:
            raise PolicyError(f"policy 'lychee': {self.mode} is a fraction in (0, 1], got {getattr(self, self.mode)}")
        positive("block_size", self.block_size, policy=self.name)
        positive("recent", self.recent, allow_zero=True, policy=self.name)
        self.retrieval: torch.Tensor | None = None  # bool [L, Hkv]
        self.policy_layers: list[int] = []  # the layers that reach plan() (all but sliding ones), set by bind()

    def bind(self, manifest: Any, config: Any) -> None:
        if manifest is None or manifest.head_role is None:
            raise PolicyError(
                "policy 'lychee' needs a manifest with a heads section (heads.role); "
                "make one with train-heads, or use policy 'full'"
            )
        self.retrieval = manifest.head_role == HEAD_ROLE_RETRIEVAL
        self.retrieval[0] = True  # layer 0 has nothing to inherit
        # Sliding-window layers never reach plan(): sets pass between the full-attention layers, and the first
        # of those has nothing to inherit (without this it would read the previous step's last set).
        sliding = set(sliding_layers(config))
        self.policy_layers = [i for i in range(len(self.retrieval)) if i not in sliding] or [0]
        self.retrieval[self.policy_layers[0]] = True

    def _choose(self, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Block scores ``[B, Hkv, n]`` → chosen block ids ``[B, Hkv, N]`` (-1 padded)."""
        n = scores.shape[-1]
        recent = math.ceil(self.recent / self.block_size) if self.recent else 0
        if self.mode in ("budget", "ratio"):
            if self.mode == "budget":
                k = torch.tensor(math.ceil(self.budget / self.block_size), device=scores.device)
            else:  # a share of the blocks holding context (blocks, not tokens: padding may split a block)
                k = (self.ratio * valid.sum(-1)).ceil()  # [B, Hkv]
            k = k.clamp_min(max(recent, 1))
            ranked = scores.float().masked_fill(~valid, float("-inf"))
            if recent:
                ranked[..., max(n - recent, 0):] = float("inf")
            order = ranked.argsort(dim=-1, descending=True, stable=True)
            rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=order.device).expand_as(order))
            k = k[..., None] if k.dim() else k
            return mask_to_indices((rank < k) & valid)
        share = scores.masked_fill(~valid, 0.0)
        share = share / share.sum(-1, keepdim=True).clamp_min(1e-30)
        if self.mode == "top_p":
            ordered, order = share.sort(dim=-1, descending=True)
            before = ordered.cumsum(-1) - ordered  # mass of the blocks ranked above
            take_sorted = before < self.top_p
            chosen = torch.zeros_like(take_sorted).scatter(-1, order, take_sorted)
        else:
            chosen = share >= self.threshold
            chosen |= share == share.amax(-1, keepdim=True)  # never empty
        if recent:
            chosen[..., max(n - recent, 0):] = True
        return mask_to_indices(chosen & valid)

    def plan(self, step: Step) -> Plan:
        b, hkv, t = step.key.shape[:3]
        retrieval = self.retrieval[step.layer].to(step.key.device)  # [Hkv]
        n_blocks = math.ceil(t / self.block_size)
        inherited = step.scratch.get("lychee.sets")  # [B, Hkv, N] block ids from the previous layer
        probs = attention_probs(step.query, step.key, step.scale, step.keep)  # [B, Hq, T]
        token_scores = probs.view(b, hkv, step.groups, t).amax(2)  # [B, Hkv, T]
        blocks = pool_pages(token_scores, self.block_size)  # [B, Hkv, n]
        valid = pool_pages(step.keep.float(), self.block_size)[:, None, :].expand(b, hkv, n_blocks) > 0
        chosen = self._choose(blocks, valid)
        if bool(retrieval.all()) or inherited is None:
            step.scratch["lychee.sets"] = chosen
            return Plan()
        # Retrieval heads read every block and pass on their choice; sparse heads read and pass on their inheritance.
        width = max(n_blocks, inherited.shape[-1])
        every = torch.arange(n_blocks, device=step.key.device).expand(b, hkv, n_blocks)
        read = torch.where(retrieval[None, :, None], _pad(every, width), _pad(inherited, width))
        width = max(chosen.shape[-1], inherited.shape[-1])
        step.scratch["lychee.sets"] = torch.where(retrieval[None, :, None], _pad(chosen, width), _pad(inherited, width))
        return Plan(indices=read, block_size=self.block_size)


    def static_step(self, shape: Any) -> LycheeStep:
        if self.retrieval is None or tuple(self.retrieval.shape) != (shape.layers, shape.kv_heads):
            raise PolicyError(f"policy 'lychee' needs head roles for {shape.layers} layers × {shape.kv_heads} KV heads; "
                              "bind it to a manifest of this model first")
        if self.mode != "budget":
            raise NotImplementedError(f"policy 'lychee' with {self.mode} has a set size that changes per step; the "
                                      "engine runs budget=N")
        recent = math.ceil(self.recent / self.block_size) if self.recent else 0
        blocks = max(math.ceil(self.budget / self.block_size), recent, 1)
        return LycheeStep(self.retrieval.clone(), self.block_size, blocks, recent,
                          passes_on(self.retrieval, self.policy_layers))


@dataclass
class LycheeStep:
    """The engine's step. A layer's retrieval heads are stored first (``head_order``: the cache keeps that
    order; the decoder reads the new token's heads in it and writes the attention's output back in the
    model's, so the weights stay the session's), so they are a head prefix that reads the whole cache, while
    the sparse heads read what they inherit (one launch below 8 rows, two from there;
    :meth:`~rolecall.runtime.engine.attention.DecodeAttention.attend_mixed_and_choose`). Within that prefix
    the heads whose choice a later layer reads (``choosing``, :func:`passes_on`) come first: only they keep
    their logits, and their block scores and top-k run beside the step; ``state["lychee.sets"]`` is that
    choice, pending until the next layer reads it. The sets ``[B, Hkv, N]`` hold the blocks per *original*
    head index, as the next layer's same head index inherits them. Nothing is copied between the two orders:
    the sparse heads read their rows through a head map (``index_rows``), and a choice is written into its
    heads' rows in place (``out_rows``)."""

    retrieval: torch.Tensor  # [L, Hkv] bool
    block_size: int
    num_blocks: int
    recent_blocks: int
    choosing: torch.Tensor  # [L, Hkv] bool: retrieval heads whose choice is read (passes_on)
    sparse: ClassVar[bool] = True
    row_lengths: ClassVar[bool] = True  # nothing is kept across steps: rows of their own lengths are fine
    paged: ClassVar[bool] = True  # reads the cache only through the decoder's attention calls (block tables)

    def __post_init__(self) -> None:
        rank = 2 - self.retrieval.to(torch.int8) - self.choosing.to(torch.int8)  # 0 choose, 1 retrieve only, 2 sparse
        self.order = [torch.argsort(row, stable=True) for row in rank]
        self.n_retrieval = [int(r) for r in self.retrieval.sum(1)]
        self.n_choosing = [int(c) for c in self.choosing.sum(1)]
        self._maps: dict[Any, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def head_order(self) -> list[torch.Tensor]:
        """Per layer, the stored order of KV heads: the retrieval heads that choose, the other retrieval heads,
        then the sparse heads (each group in original order)."""
        return self.order

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return (self.block_size,)

    def reads(self, shape: Any, context: int) -> float:
        full = self.retrieval.float().mean(1).tolist()  # the share of each layer's KV heads that retrieve
        return mean_tokens_read(shape, context, self.num_blocks * self.block_size, full)

    def _device_maps(self, device: Any, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, int32 on ``device``: the stored order (stored head j holds original head ``order[j]``), and
        the rows of ``[B, Hkv]`` the choice of the layer's c choosing heads (stored first) goes to,
        ``b · Hkv + order[j]`` for row ``b · c + j``. Made once, in the eager warm-up before any graph capture."""
        key = (device, batch)
        if key not in self._maps:
            hkv = self.retrieval.shape[1]
            base = torch.arange(batch, device=device, dtype=torch.int32)[:, None] * hkv
            maps = []
            for order, c in zip(self.order, self.n_choosing):
                order = order.to(device=device, dtype=torch.int32)
                rows = base + order[None, :]  # [B, Hkv]: row b's stored head j → its row by original head
                maps.append((order, rows[:, :c].flatten().contiguous()))  # [B, 1] flattens to a strided view
            self._maps[key] = maps
        return self._maps[key]

    def attention(self, dec: Any, layer: int, q, k, v, span, state: dict) -> Any:
        b, hkv = q.shape[0], k.shape[1]  # k: the rows' keys, or a pool of pages (span.table)
        order, out_rows = self._device_maps(k.device, b)[layer]
        r, c, bs, n = self.n_retrieval[layer], self.n_choosing[layer], self.block_size, self.num_blocks
        pending = state.get("lychee.sets")  # Pending([B, Hkv, N] by original head index), chosen beside the step
        sets = pending.result() if pending is not None else None
        if r == hkv or sets is None:  # every head reads everything (the first layer): one dense launch
            if sets is None and c:  # the first choice: rows no choice writes are never read (passes_on)
                sets = torch.empty(b, hkv, min(n, math.ceil(span.slots(k) / bs)), device=k.device, dtype=torch.int32)
            out, chosen = dec.attn.attend_and_choose(q, k, v, span, bs, True, n, self.recent_blocks, out=sets,
                                                out_rows=out_rows, choosing=c)
        elif r == 0:  # every head reads what it inherits
            return dec.attn.attend(q, k, v, span, sets, bs, index_rows=order)
        else:  # retrieval heads (stored first) read all, the first c of them choose; sparse heads read their sets
            out, chosen = dec.attn.attend_mixed_and_choose(q, k, v, span, sets, bs, r, n, self.recent_blocks,
                                                      index_rows=order, out=sets, out_rows=out_rows, choosing=c)
        if chosen is not None:  # written into sets' rows of this layer's choosing heads
            state["lychee.sets"] = chosen
        return out


def passes_on(retrieval: torch.Tensor, layers: Any) -> torch.Tensor:
    """``[L, Hkv]`` bool: the retrieval heads whose choice a later layer reads. Head h's choice at layer l is
    read by the next of ``layers`` (those that run the policy) if head h is sparse there, and by nobody else:
    a sparse head passes the set on unchanged, and a retrieval head replaces it. So a retrieval head followed by
    a retrieval head of the same index, or in the last such layer, needs neither logits nor a choice."""
    out = torch.zeros_like(retrieval, dtype=torch.bool)
    layers = list(layers)
    for here, after in zip(layers, layers[1:]):
        out[here] = retrieval[here] & ~retrieval[after]
    return out


def _pad(indices: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(indices, (0, width - indices.shape[-1]), value=-1)
