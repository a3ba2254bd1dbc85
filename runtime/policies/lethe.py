"""``lethe``: Lethe (AAAI-26) — per-layer KV budgets and eviction during decoding.

Each decode step a layer adds its attention to decayed token scores ``s_t = γ s_{t-1} + a_t`` (``a_t``: the
mean over query heads of the softmax probability). When the layer holds more slots than its budget it
keeps the ``sinks`` first tokens, the most recent ``recent_ratio`` of the budget, and from the rest the
tokens chosen by a segmented top-k with a breakpoint: the candidates up to the ``tau`` share of their score
mass (the breakpoint, at most the remaining budget) are spread over ``segments`` equal position segments in
proportion to each segment's mass, and each segment keeps its best tokens.

Budget per layer:

* ``budget`` (tokens) — a fixed size, shared out over layers in proportion to the manifest's
  ``layers.budget``; memory stops growing once it is reached;
* otherwise a fraction of the context: ``layers.budget[l]`` (rescaled to mean ``sparse_ratio`` when given,
  or ``sparse_ratio`` for every layer without a manifest).

With the cache from ``Session.cache()`` (a :class:`LetheCache`) evicted slots are really freed: the layer's
tensors are rebuilt with the kept slots and the logical position of every slot is remembered, so masks
(built by transformers from the logical length) still line up. With any other cache the same slots are
masked instead (identical results, no memory saved). Beam search is not supported by ``LetheCache``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rolecall.core.models import sliding_layers
from rolecall.runtime.engine.cache import KeySpan
from rolecall.runtime.kernels.page_scores import attention_probs
from rolecall.runtime.kernels.topk_select import mask_to_indices
from rolecall.runtime.policies import Plan, PolicyError, Step, positive


class EvictingLayer(DynamicLayer):
    """A DynamicLayer whose slots can be dropped; ``positions`` ``[B, T_slots]`` maps slots to logical positions."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.positions: torch.Tensor | None = None
        self.seen = 0  # logical length: every token ever appended

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        b, s = key_states.shape[0], key_states.shape[-2]
        new = torch.arange(self.seen, self.seen + s, device=key_states.device).expand(b, s)
        self.positions = new if self.positions is None else torch.cat([self.positions, new], dim=-1)
        self.seen += s
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def contiguous(self) -> bool:
        return self.keys is None or self.keys.shape[-2] == self.seen

    def gather_mask(self, keep: torch.Tensor) -> torch.Tensor:
        """A logical mask ``[B or 1, 1, S, seen]`` → the slots' mask ``[B, 1, S, T_slots]``."""
        b, t = self.positions.shape
        keep = keep.expand(b, 1, keep.shape[2], keep.shape[3])
        return keep.gather(-1, self.positions[:, None, None, :].expand(b, 1, keep.shape[2], t))

    def evict(self, keep: torch.Tensor) -> None:
        """Keep only the slots ``keep`` ``[B, n]`` (ascending); the old tensors are released."""
        b, hkv, _, d = self.keys.shape
        index = keep[:, None, :, None].expand(b, hkv, keep.shape[1], d)
        self.keys = self.keys.gather(2, index)
        self.values = self.values.gather(2, index)
        self.positions = self.positions.gather(1, keep)

    def reset(self) -> None:
        super().reset()
        self.positions, self.seen = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise PolicyError("policy 'lethe' does not support beam search (its scores follow one sequence per row); "
                          "generate with num_beams=1")

    def crop(self, tokens_to_remove: int) -> None:
        raise PolicyError("policy 'lethe' cannot crop a cache it has evicted from (assisted decoding); "
                          "generate without an assistant model")

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class LetheCache(DynamicCache):
    """A DynamicCache whose full-attention layers can evict; it tells the session which layer served last."""

    def __init__(self, config: Any, session: Any) -> None:
        super().__init__(config=config)
        if self.layers:
            self.layers = [EvictingLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]
        else:
            self.layer_class_to_replicate = EvictingLayer
        self.session = session

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if isinstance(self.layers[layer_idx], EvictingLayer):
            self.session.cache_layers[layer_idx] = self.layers[layer_idx]
        return out

    def nbytes(self) -> int:
        """Bytes held by keys and values over all layers."""
        total = 0
        for layer in self.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total

    def slots(self) -> list[int]:
        """Slots held per layer."""
        return [int(layer.keys.shape[-2]) if getattr(layer, "keys", None) is not None else 0 for layer in self.layers]


@dataclass
class Lethe:
    sparse_ratio: float | None = None  # mean fraction of the context kept
    budget: int | None = None  # mean slots per layer (fixed size)
    recent_ratio: float = 0.1  # share of a layer's budget kept for the most recent tokens
    gamma: float = 0.9  # score decay per step
    segments: int = 4  # D
    tau: float = 0.95  # breakpoint: share of the candidates' score mass worth keeping
    sinks: int = 4
    name: ClassVar[str] = "lethe"

    def __post_init__(self) -> None:
        if self.sparse_ratio is not None and not 0 < self.sparse_ratio <= 1:
            raise PolicyError(f"policy 'lethe': sparse_ratio is a fraction in (0, 1], got {self.sparse_ratio!r}")
        if self.budget is not None:
            positive("budget", self.budget, policy=self.name)
        for key, low, high in (("recent_ratio", 0, 1), ("gamma", 0, 1), ("tau", 0, 1)):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not low <= value <= high:
                raise PolicyError(f"policy 'lethe': {key} must be in [{low}, {high}], got {value!r}")
        positive("segments", self.segments, policy=self.name)
        positive("sinks", self.sinks, allow_zero=True, policy=self.name)
        self.weights: torch.Tensor | None = None  # [L] per-layer share
        self.policy_layers: list[int] = []  # layers that share the budget (not sliding-window ones)

    def bind(self, manifest: Any, config: Any) -> None:
        budget = manifest.layer_budget if manifest is not None else None
        if budget is None and self.sparse_ratio is None and self.budget is None:
            raise PolicyError(
                "policy 'lethe' needs a manifest with layers.budget (calibrate-delta writes it), "
                "or sparse_ratio=<fraction kept> or budget=<tokens per layer>"
            )
        layers = int(getattr(config, "num_hidden_layers", 0) or len(budget))
        self.weights = budget.clamp_min(1e-6) if budget is not None else torch.ones(layers)
        # Sliding-window layers get no budget (their window is their budget, and they never reach plan()), so
        # the shares are normalised over the full-attention layers only.
        sliding = set(sliding_layers(config))
        self.policy_layers = [i for i in range(len(self.weights)) if i not in sliding] or list(range(len(self.weights)))

    def make_cache(self, session: Any) -> LetheCache:
        return LetheCache(session.model.config, session)

    def capacity(self, layer: int, logical: int) -> int:
        """Slots layer ``layer`` may hold at logical length ``logical``."""
        w = self.weights[layer]
        mean = self.weights[self.policy_layers].mean()
        if self.budget is not None:
            cap = round(self.budget * float(w / mean))
        else:
            frac = float(w * self.sparse_ratio / mean) if self.sparse_ratio is not None else float(w)
            cap = math.ceil(min(frac, 1.0) * logical)
        return max(cap, self.sinks + 2)

    def plan(self, step: Step) -> Plan:
        b, _, t = step.key.shape[:3]
        layer = step.layer
        physical = step.cache_layer is not None
        if physical:
            slots = torch.arange(t, device=step.key.device).expand(b, t)  # every stored slot is alive
            mask = step.keep
            logical = step.cache_layer.seen
        else:
            alive = step.scratch.get(f"lethe.alive.{layer}")
            if alive is None or alive.shape[-1] > t or alive.shape[0] != b:
                alive = torch.ones(b, t, dtype=torch.bool, device=step.key.device)
            alive = torch.nn.functional.pad(alive, (0, t - alive.shape[-1]), value=True)
            slots = mask_to_indices(alive)  # [B, n] logical position of each live slot
            mask = step.keep & alive
            logical = t
        probs = attention_probs(step.query, step.key, step.scale, mask).mean(1)  # [B, T]
        attention = probs.gather(1, slots)  # [B, n]
        scores = step.scratch.get(f"lethe.scores.{layer}")
        if scores is None or scores.shape[-1] > attention.shape[-1] or scores.shape[0] != b:
            scores = torch.zeros_like(attention)
        scores = self.gamma * torch.nn.functional.pad(scores, (0, attention.shape[-1] - scores.shape[-1])) + attention
        valid = mask.gather(1, slots)
        n = slots.shape[-1]
        cap = self.capacity(layer, logical)
        if n > cap:
            kept = self._keep(scores, valid, cap)  # [B, n'] ascending slot ids
            scores = scores.gather(1, kept)
            if physical:
                step.cache_layer.evict(kept)
            else:
                survivors = torch.zeros_like(alive)
                survivors.scatter_(1, slots.gather(1, kept), True)
                alive = survivors
            n = kept.shape[-1]
        step.scratch[f"lethe.scores.{layer}"] = scores
        if not physical:
            step.scratch[f"lethe.alive.{layer}"] = alive
        return Plan(key_mask=mask, info={"kept_fraction": n / logical})

    def recent_slots(self, cap: int) -> int:
        return min(math.ceil(self.recent_ratio * cap), cap - 1)

    def static_step(self, shape: Any) -> LetheStep:
        if self.budget is None:
            raise NotImplementedError("policy 'lethe' with a share of the context keeps a number of slots that grows "
                                      "per step; the engine runs budget=N")
        if self.weights is None or len(self.weights) != shape.layers:
            raise PolicyError(f"policy 'lethe' needs per-layer budgets for {shape.layers} layers; bind it to a "
                              "manifest of this model (or to none, with budget=N) first")
        return LetheStep(self, {i: self.capacity(i, 0) for i in self.policy_layers})

    def _keep(self, scores: torch.Tensor, valid: torch.Tensor, cap: int) -> torch.Tensor:
        """Slots to keep ``[B, n']`` (ascending, ``n' ≤ cap``, the same count in every row)."""
        b, n = scores.shape
        recent = self.recent_slots(cap)
        chosen, priority = [], []
        for row in range(b):
            ok = valid[row]
            protect = ok & (ok.cumsum(0) <= self.sinks)
            protect[n - recent:] |= ok[n - recent:] if recent else False
            protect[n - 1] = True  # the current token
            candidates = ok & ~protect
            room = max(cap - int(protect.sum()), 0)
            picked = protect | self._segmented(scores[row], candidates, room)
            chosen.append(picked)
            # Fill order for rows that keep fewer than others: best remaining candidates, then anything.
            rest = torch.where(candidates & ~picked, scores[row], torch.where(picked, math.inf, -math.inf))
            priority.append(rest)
        count = min(max(int(c.sum()) for c in chosen), cap)
        keep = torch.zeros(b, n, dtype=torch.bool, device=scores.device)
        for row in range(b):
            order = priority[row].argsort(descending=True, stable=True)[:count]
            keep[row, order] = True
        return mask_to_indices(keep)

    def _segmented(self, scores: torch.Tensor, candidates: torch.Tensor, room: int) -> torch.Tensor:
        """Segmented top-k with a breakpoint over ``candidates`` ``[n]``; returns a bool ``[n]``."""
        picked = torch.zeros_like(candidates)
        ids = candidates.nonzero().flatten()
        if room == 0 or ids.numel() == 0:
            return picked
        s = scores[ids].clamp_min(0)
        total = float(s.sum())
        ordered = s.sort(descending=True).values
        reach = int((ordered.cumsum(0) < self.tau * total).sum()) + 1 if total > 0 else room
        k = min(room, reach, ids.numel())
        parts = torch.tensor_split(torch.arange(ids.numel(), device=ids.device), min(self.segments, ids.numel()))
        mass = torch.stack([s[p].sum() for p in parts]) + 1e-12
        share = mass / mass.sum() * k
        quota = share.floor().long()
        for i in (share - quota).argsort(descending=True, stable=True)[: k - int(quota.sum())]:
            quota[i] += 1
        for p, q in zip(parts, quota.tolist()):
            q = min(q, p.numel())
            if q:
                picked[ids[p[s[p].argsort(descending=True, stable=True)[:q]]]] = True  # ties: the earlier slot
        short = k - int(picked.sum())
        if short > 0:  # a segment had fewer tokens than its quota: take the best of the rest
            rest = torch.where(picked[ids], -math.inf, s)
            picked[ids[rest.argsort(descending=True, stable=True)[:short]]] = True
        return picked


def keep_on_device(scores: torch.Tensor, valid: torch.Tensor, alive: torch.Tensor, cap: int, sinks: int,
                   recent: int, segments: int, tau: float, per_row: bool = False) -> torch.Tensor:
    """:meth:`Lethe._keep` on fixed shapes, for slots in position order: ``[B, S]`` bool of the slots kept.

    ``alive`` marks the slots the layer holds (the reference's compact list, in the same order), ``valid``
    those of them the query may read, ``scores`` their decayed scores. Every row keeps the same count
    ``min(max over rows of its choice, cap)``, filled as the reference fills it; with ``per_row`` each row keeps
    its own choice's count (at most ``cap``): the scheduler's rows, each a request decoded as alone. No host
    sync."""
    b, s = scores.shape
    device = scores.device
    ok = valid & alive
    after = alive.flip(-1).cumsum(-1).flip(-1) - alive.long()  # alive slots after each slot
    protect = ok & (ok.cumsum(-1) <= sinks)
    protect |= ok & (after < recent)
    protect |= alive & (after == 0)  # the current token
    candidates = ok & ~protect
    room = (cap - protect.sum(-1)).clamp_min(0)  # [B]
    picked = _segmented_on_device(scores, candidates, room, segments, tau)
    chosen = protect | picked
    count = chosen.sum(-1).clamp(max=cap)  # [B]: each row's own count, or one for every row
    count = count[:, None] if per_row else count.amax()
    # kept first, then the best other candidates, then the other slots held (the reference's -inf, in order);
    # slots not held come last
    priority = torch.where(candidates & ~picked, scores, torch.where(chosen, math.inf, -1.0))
    priority = priority.masked_fill(~alive, -math.inf)
    order = priority.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(s, device=device).expand(b, s))
    return rank < count


def _segmented_on_device(scores: torch.Tensor, candidates: torch.Tensor, room: torch.Tensor, segments: int,
                         tau: float) -> torch.Tensor:
    """:meth:`Lethe._segmented` for every row at once: ``[B, S]`` bool."""
    b, s = scores.shape
    device = scores.device
    v = torch.where(candidates, scores.clamp_min(0), 0.0)
    m = candidates.sum(-1)  # [B] candidates per row
    total = v.sum(-1)
    ordered = v.sort(-1, descending=True).values
    reach = torch.where(total > 0, (ordered.cumsum(-1) < tau * total[:, None]).sum(-1) + 1, room)
    k = torch.minimum(torch.minimum(room, reach), m)  # [B]
    # torch.tensor_split of the m candidates into p = min(segments, m) parts: the first m % p take one more
    p = m.clamp(min=1, max=segments)
    rank = candidates.long().cumsum(-1) - 1  # a candidate's place among its row's candidates
    base, extra = (m // p)[:, None], (m % p)[:, None]
    big = extra * (base + 1)
    part = torch.where(rank < big, rank // (base + 1), extra + (rank - big) // base.clamp_min(1))
    part = torch.where(candidates, part, segments)  # non-candidates in a spare part
    mass = torch.zeros(b, segments + 1, device=device).scatter_add_(-1, part, v)[:, :segments]
    present = torch.arange(segments, device=device)[None, :] < p[:, None]
    mass = torch.where(present, mass + 1e-12, 0.0)
    share = mass / mass.sum(-1, keepdim=True) * k[:, None]
    quota = share.floor().long()
    left = k - quota.sum(-1)  # [B]
    frac_order = torch.where(present, share - quota, -1.0).argsort(dim=-1, descending=True, stable=True)
    bonus = torch.zeros_like(quota).scatter_(-1, frac_order, (torch.arange(segments, device=device)[None, :]
                                                              < left[:, None]).long())
    sizes = torch.zeros(b, segments + 1, dtype=torch.long, device=device).scatter_add_(
        -1, part, torch.ones_like(part))[:, :segments]
    quota = torch.minimum(quota + bonus, sizes)  # [B, segments]
    # within each part, its best `quota` candidates: rank by (part, score descending)
    key = torch.where(candidates, -v, math.inf)
    order = torch.sort(key, dim=-1, stable=True).indices
    order = order.gather(-1, torch.sort(part.gather(-1, order), dim=-1, stable=True).indices)  # by part, then score
    part_sorted = part.gather(-1, order)
    start = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=device), sizes.cumsum(-1)], -1)  # part starts
    place = torch.arange(s, device=device)[None, :] - start.gather(-1, part_sorted.clamp(max=segments))
    limit = torch.cat([quota, torch.zeros(b, 1, dtype=torch.long, device=device)], -1).gather(-1, part_sorted)
    picked = torch.zeros_like(candidates).scatter_(-1, order, place < limit)
    short = k - picked.sum(-1)  # a part had fewer candidates than its quota: the best of the rest
    rest = torch.where(candidates & ~picked, v, -math.inf)
    rest_order = rest.argsort(dim=-1, descending=True, stable=True)
    take = torch.arange(s, device=device)[None, :] < short[:, None]
    return picked | torch.zeros_like(picked).scatter_(-1, rest_order, take & (rest.gather(-1, rest_order) > -math.inf))


def compaction_order(keep: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` slot indices: the kept slots in order, then the others in order (what a stable sort of
    ``~keep`` gives), from two running counts and one scatter instead of a sort."""
    slot = torch.arange(keep.shape[-1], device=keep.device).expand_as(keep)
    kept = keep.long().cumsum(-1) - 1
    dropped = keep.sum(-1, keepdim=True) + (~keep).long().cumsum(-1) - 1
    return torch.empty_like(slot).scatter_(-1, torch.where(keep, kept, dropped), slot)


def evict(p: Lethe, q, k, v, held, scores, pos, count, keep, mask, cap: int, scale: float,
          running: torch.Tensor | None = None) -> None:
    """Lethe ``p``'s eviction in the engine's step: add this step's attention to the decayed scores and, past
    ``cap``, keep what :func:`keep_on_device` chooses, moved to the front of the buffers (one gather) in
    position order; every tensor in place. ``count`` is one for every row (``[]``) or each row's own (``[B]``,
    the scheduler's rows, where ``running [B]`` bool says which rows wrote a new token this step: an idle row
    holds ``count`` slots and evicts nothing). A function, not a method: a step that kept its own bound method
    (compiled) would form a reference cycle, and its cache buffers would then wait for the garbage collector."""
    rows = count.dim() == 1
    slot = torch.arange(held.shape[1], device=held.device)
    updated = p.gamma * scores + attention_probs(q, k, scale, mask).mean(1)
    kept = keep_on_device(updated, keep, held, cap, p.sinks, p.recent_slots(cap), p.segments, p.tau, per_row=rows)
    over = count >= cap  # every row holds slots 0..count (the new token's included): count + 1 of them
    if rows:
        over = (over & running)[:, None]
    now = torch.where(over, kept, held)  # the same count in every row, or each row's own
    order = compaction_order(now)
    width = min(held.shape[1], cap + 1)  # at most max(cap, count + 1 before any eviction) slots are kept
    at = order[:, None, :width, None].expand(-1, k.shape[1], -1, k.shape[3])
    k[:, :, :width].copy_(k.gather(2, at))
    v[:, :, :width].copy_(v.gather(2, at))
    total = now.sum(-1) if rows else now.sum(-1)[0]
    held.copy_((slot < (total[:, None] if rows else total)).expand_as(held))
    scores.copy_(torch.where(held, updated.gather(1, order), 0.0))
    pos.copy_(pos.gather(1, order))
    count.copy_(total)


@dataclass
class LetheStep:
    """The engine's step. Each layer keeps its tokens compact, in position order, in the first slots of its
    cache buffer, beside them which slots it holds, their decayed scores and the cache position each slot
    stands for (``pos``), and ``count``, the slots in use: the new token is written at ``count``, the step
    attends over the held slots (the probabilities, mean over heads, from :func:`attention_probs` as in the
    reference), adds them to the scores and, past the layer's capacity, keeps what :func:`keep_on_device`
    chooses and moves the kept slots to the front (one gather), as the transformers path's
    :class:`LetheCache` rebuilds its tensors. A decoder that makes its own cache sizes these layers to
    ``max(prompt, capacity) + 1`` slots for the prefill (:meth:`cache_slots`); with a shared request-sized
    cache the same happens inside the larger buffer. The step runs from the first token (its scores start
    there), so it has no full-attention fallback.

    After its first step a layer never holds more than ``cap`` slots (the step that reaches ``cap + 1`` evicts),
    so there the decoder lets it :meth:`settle`: each prompt-sized buffer (16,001 slots at 16K against 1,025 at
    a 1K budget) is replaced by a copy of its first ``cap + 1`` slots and freed, and the step is captured over
    the small buffers. The memory held while decoding is then bounded by the budget, and no sort or attention
    covers the unused slots. A cache shared with other decoders (benchmarks) keeps its size."""

    policy: Lethe
    caps: dict[int, int]  # layer -> slots it may hold
    head_order: ClassVar[None] = None
    sparse: ClassVar[bool] = True
    full_fallback: ClassVar[bool] = False
    row_lengths: ClassVar[bool] = True  # each row keeps its own count, scores and positions (the scheduler's rows)
    reusable: ClassVar[bool] = False  # settling shrinks its buffers: the next request needs prompt-sized ones
    block_sizes: ClassVar[tuple[int, ...]] = ()
    _compiled: Any = field(default=None, init=False, repr=False)

    @property
    def owned_layers(self) -> set[int]:
        return set(self.caps)

    def cache_slots(self, max_len: int, prompt_tokens: int | None) -> dict[int, int] | None:
        """Slots each compact layer needs for a prompt of ``prompt_tokens`` (None: no bound, every slot)."""
        if prompt_tokens is None:
            return None
        return {i: min(max_len, max(prompt_tokens, cap) + 1) for i, cap in self.caps.items()}

    def reads(self, shape: Any, context: int) -> float:
        per_layer = [min(context, self.caps[i]) if i in self.caps else context for i in range(shape.layers)]
        return sum(per_layer) / len(per_layer)

    def prepare(self, dec: Any) -> None:
        c, device = dec.cache, dec.cache.length.device
        n = {i: c.k[i].shape[2] for i in self.caps}
        self.held = {i: torch.zeros(c.batch, n[i], dtype=torch.bool, device=device) for i in self.caps}
        self.scores = {i: torch.zeros(c.batch, n[i], device=device) for i in self.caps}
        self.pos = {i: torch.zeros(c.batch, n[i], dtype=torch.long, device=device) for i in self.caps}
        rows = (c.batch,) if c.row_lengths else ()  # the scheduler's rows: each its own count
        self.count = {i: torch.zeros(rows, dtype=torch.long, device=device) for i in self.caps}
        self.buffers = [t for i in self.caps for t in (c.k[i], c.v[i])]

    def state(self) -> list[torch.Tensor]:
        """The buffers a step changes (the engine restores them after a CUDA-graph capture's warm-up)."""
        return [*self.held.values(), *self.scores.values(), *self.pos.values(), *self.count.values(), *self.buffers]

    def write_slots(self) -> dict[int, torch.Tensor]:
        return self.count

    def steps_to_settle(self, dec: Any) -> int | None:
        """Steps after a fill before :meth:`settle`: none when every layer already holds at most its capacity
        (its new token then lands inside the first ``cap + 1`` slots), else one; never (None) on the scheduler's
        rows, whose buffers hold the next request's prompt."""
        if dec.cache.row_lengths:
            return None
        held = {i: min(dec.position, self.held[i].shape[1] - 1) for i in self.caps}
        return 0 if all(held[i] <= cap for i, cap in self.caps.items()) else 1

    def _oversized(self, dec: Any) -> list[int]:
        """The layers whose buffers :meth:`settle` shrinks: wider than ``cap + 1``, in a cache of the decoder's own."""
        return [i for i, cap in self.caps.items()
                if dec.owns_cache and not dec.cache.row_lengths and dec.cache.k[i].shape[2] > cap + 1]

    def settle(self, dec: Any) -> bool:
        """Each layer of a cache of the decoder's own keeps only its first ``cap + 1`` slots (new, smaller
        buffers; the old ones are freed); returns whether any buffer changed."""
        c, layers = dec.cache, self._oversized(dec)
        for i in layers:
            w = self.caps[i] + 1
            c.k[i], c.v[i] = c.k[i][:, :, :w].clone(), c.v[i][:, :, :w].clone()
            for state in (self.held, self.scores, self.pos):
                state[i] = state[i][:, :w].clone()
        if layers:
            self.buffers = [t for i in self.caps for t in (c.k[i], c.v[i])]
            self._compiled = None  # compiled for the small buffers from here on
        return bool(layers)

    def _evictor(self, dec: Any) -> Any:
        """:func:`evict`, as the decoder compiles it (:meth:`StaticDecoder.compiled`): its few dozen small ops
        (scores, the segmented choice, the sorts and gathers) fuse into a handful of kernels; the second layer
        shape makes the buffer sizes and the capacity symbolic, and that graph serves every layer."""
        if self._compiled is None:
            self._compiled = dec.compiled(evict)
        return self._compiled

    def after_fill(self, dec: Any, row: int | None = None) -> None:
        """A prefill leaves every slot of the prompt held, in place, its scores at zero. A length declared past
        a layer's buffer (``set_length`` over a benchmark's random cache) stands for the steady state instead:
        the layer holds the most recent ``slots - 1`` positions, one free slot for the next token. ``row``: only
        that row of the scheduler's took a new request (its prompt's length is its length in the cache); the
        other rows' state is theirs."""
        length = dec.position if row is None else int(dec.cache.length[row])
        rows = slice(None) if row is None else slice(row, row + 1)
        for i in self.caps:
            n = self.held[i].shape[1]
            held = min(length, n - 1)
            slot = torch.arange(n, device=self.held[i].device)
            self.held[i][rows] = slot < held
            self.scores[i][rows] = 0.0
            self.pos[i][rows] = slot + length - held
            if row is None:
                self.count[i].fill_(held)
            else:
                self.count[i][row] = held
        if self._oversized(dec):
            # the step over prompt-sized buffers runs once, before settle(): eagerly, not compiled for that width
            # (torch.compile's inductor failed on 16,001 slots, which then made every later eviction eager too)
            self._compiled = evict

    def attention(self, dec: Any, layer: int, q, k, v, span, state: dict) -> Any:
        if layer not in self.caps:
            return dec.attn.attend(q, k, v, span)
        held, scores, pos, count = self.held[layer], self.scores[layer], self.pos[layer], self.count[layer]
        slot = torch.arange(held.shape[1], device=held.device)
        running = None
        if count.dim():  # the scheduler's rows: each at its own count, and an idle row takes no new token
            running = dec.stopper.running().bool()
            new = (slot[None, :] == count[:, None]) & running[:, None]
            last = span.last[:, None]
        else:
            new, last = slot == count, span.last  # the new token's slot (written there by the engine)
        held.logical_or_(new)
        pos.copy_(torch.where(new, last, pos))
        keep = (pos >= span.first[:, None]) & (pos <= last)  # [B, S]: what the query may read
        mask = keep & held
        out = dec.attn.attend(q, k, v, KeySpan(torch.zeros_like(span.first), count), key_mask=mask)
        self._evictor(dec)(self.policy, q, k, v, held, scores, pos, count, keep, mask, self.caps[layer],
                           dec.shape.attention_scale, running)
        return out
