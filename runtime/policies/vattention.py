"""``vattention``: vAttention (ICLR 2026) — sparse attention with a verified error bound, per KV head.

Each head reads a deterministic set — ``sinks`` first tokens, the last ``window`` tokens and the ``heavy``
tokens of highest attention — plus ``b`` uniform draws (with replacement: i.i.d., the CLT's own assumption)
from the ``n_r`` remaining tokens, each draw weighted by ``n_r / b``; where ``b ≥ n_r`` the remainder is read
whole at weight 1. The sample size ``b`` comes from the central limit theorem
(the paper's Algorithm 2): a pilot sample estimates the spread of the residual terms of the softmax
numerator ``N = Σ e^{s_i} v_i`` and denominator ``D = Σ e^{s_i}``; with ``η = ε / (2 + ε)``,

    b_D = (z · n_r · σ_D / (η · D))²,   b_N = (z · n_r · sqrt(tr Σ_N) / (η · ‖N‖))²,   b = max(b_N, b_D)

where ``z = Φ⁻¹(1 − δ/4)``. If ``|D̂ − D| ≤ ηD`` and ``‖N̂ − N‖ ≤ η‖N‖`` then the output ``N̂/D̂`` is within
relative error ``2η / (1 − η) = ε``; each bound fails with probability ≤ δ/2. One sample serves the query
heads of a KV head, so ``b`` is the max over them.

Heavy hitters use exact scores; with a DELTA manifest (``layers.role``) full layers stay dense, Δ-layers
publish ``max_h p_h[t]`` and the sparse layers after them rank heavy hitters by it (DELTA + vAttention).

The shift of the softmax cancels in ``b``; both paths take the deterministic set's own log-sum-exp, so the
statistics are those of an attention pass over that set plus the pilot's logits. A draw is a rank among the
remaining slots, mapped to its slot by counting the deterministic slots below it (:func:`residual_slots`: no
pass over the cache); its uniform comes from a hash of ``(seed, tokens so far, layer, row, KV head, draw)``
(:func:`token_uniforms`), so the transformers path, the engine's graph-captured step and any device draw the
same sample. ``max_sample`` caps ``b`` (then the bound
is no longer guaranteed where the cap binds); the engine needs it, since its shapes are fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rolecall.core.manifest import LAYER_ROLE_FULL, LAYER_ROLE_SELECT, LAYER_ROLE_SPARSE
from rolecall.runtime.engine.sampling import M32, mix32
from rolecall.runtime.kernels.paged_attention.tables import gather_tokens
from rolecall.runtime.kernels.topk_select.naive import top_stable
from rolecall.runtime.policies import Plan, PolicyError, Step, positive

PILOT, SAMPLE = 0, 1  # the two draws of a step: the pilot and the sample
ABSENT = 1 << 40  # sorts after every slot


def token_uniforms(seed: int, stream: int, tokens: torch.Tensor | int, layer: int, shape: tuple[int, int, int],
                   device: Any, row_keys: bool = True) -> torch.Tensor:
    """Uniforms in (0, 1) ``[B, Hkv, M]`` from a hash of (seed, stream, tokens so far, layer, row, KV head,
    draw); ``tokens`` and ``layer`` may be device scalars (the engine's length; a compiled step's layer), and
    ``tokens`` ``[B]``, each row's own (the scheduler's rows). Without ``row_keys`` every row hashes as row 0:
    each of the scheduler's rows is a request of its own and draws what it would draw alone."""
    b, hkv, m = shape
    tokens = torch.as_tensor(tokens, device=device).long()
    h = mix32((tokens.view(-1, 1, 1) if tokens.dim() else tokens) * 0x2545F491 + seed & M32)
    h = mix32(h ^ ((torch.as_tensor(layer, device=device).long() * 0x9E3779B + stream * 0x632BE5AB) & M32))
    rows = torch.arange(b, device=device, dtype=torch.long) if row_keys else torch.zeros(b, device=device,
                                                                                          dtype=torch.long)
    h = mix32(h ^ (rows[:, None, None] * 0x27D4EB2F & M32))
    h = mix32(h ^ (torch.arange(hkv, device=device, dtype=torch.long)[None, :, None] * 0x165667B1 & M32))
    h = mix32(h ^ torch.arange(m, device=device, dtype=torch.long)[None, None, :])
    return (h.double() + 0.5) / 4294967296.0


def heavy_hitters(scores: torch.Tensor, first: torch.Tensor, last: torch.Tensor | int, sinks: int, window: int,
                  heavy: int) -> torch.Tensor:
    """``scores [B, H, T]`` → ``[B, H, min(heavy, T)]`` the slots of highest score among the valid ones
    (``first[b]..last``) outside the sinks and the window, -1 where there are fewer."""
    slot = torch.arange(scores.shape[-1], device=scores.device)
    outside = (slot >= first[:, None, None] + sinks) & (slot <= per_row(last, 2) - window)
    ranked = top_stable(scores.masked_fill(~outside, float("-inf")), heavy)  # ties: the earlier slot, any width
    return torch.where(ranked.values > float("-inf"), ranked.indices, -1)


def fixed_slots(first: torch.Tensor, last: torch.Tensor | int, sinks: int, window: int,
                heavy: torch.Tensor) -> torch.Tensor:
    """The deterministic set ``[B, Hkv, sinks + window + H]`` (-1 = absent, no slot twice): the first ``sinks``
    valid slots, the window's slots after them up to ``last``, then ``heavy [B, Hkv, H]``."""
    b, hkv = heavy.shape[:2]
    device = first.device
    head = first[:, None] + torch.arange(sinks, device=device)  # [B, S]
    head = torch.where(head <= per_row(last, 1), head, -1)
    tail = (per_row(last, 1) - window + 1 + torch.arange(window, device=device)).expand(b, window)
    tail = torch.where(tail >= first[:, None] + sinks, tail, -1)  # not a sink, not before the first valid slot
    return torch.cat([head[:, None].expand(b, hkv, sinks), tail[:, None].expand(b, hkv, window), heavy], -1)


def per_row(last: torch.Tensor | int, dims: int) -> torch.Tensor | int:
    """``last`` (one slot for all rows, or ``[B]``: each row's own) shaped to broadcast over ``dims`` more
    trailing dimensions of a ``[B, ...]`` tensor."""
    if isinstance(last, torch.Tensor) and last.dim():
        return last.view(-1, *([1] * dims))
    return last


def free_before(fixed: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``fixed [B, H, F]`` → its slots' offsets from ``first[b]`` in ascending order (absent ones last) less their
    place: the j-th is the number of free slots before the j-th fixed one (what :func:`residual_slots` counts)."""
    offsets = torch.where(fixed >= 0, fixed - first[:, None, None], ABSENT).sort(-1).values
    return offsets - torch.arange(offsets.shape[-1], device=offsets.device)


def residual_slots(ranks: torch.Tensor, fixed: torch.Tensor, first: torch.Tensor,
                   free: torch.Tensor | None = None) -> torch.Tensor:
    """``ranks [B, Hkv, M]`` → the slot of each rank among the valid slots from ``first[b]`` on that are not in
    ``fixed [B, Hkv, F]``: ``first + rank + #{fixed slots before it}`` (``free``: :func:`free_before` of
    ``fixed``, when already known)."""
    free = free_before(fixed, first) if free is None else free
    count = (free[:, :, None, :] <= ranks[..., None]).sum(-1)
    return first[:, None, None] + ranks + count


@dataclass
class VAttention:
    epsilon: float = 0.05  # target relative error of each head's output
    delta: float = 0.05  # allowed failure probability
    sinks: int = 4
    window: int = 64  # ≥ 1: the new token is always read
    heavy: int = 64  # top-k heavy hitters per KV head
    pilot: int = 64  # pilot draws that estimate the residual's spread
    max_sample: int | None = None  # cap on the draws per KV head (None: the bound's size; the engine needs one)
    seed: int = 0
    name: ClassVar[str] = "vattention"

    def __post_init__(self) -> None:
        for key in ("epsilon", "delta"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not 0 < value < 1:
                raise PolicyError(f"policy 'vattention': {key} must be in (0, 1), got {value!r}")
        for key in ("sinks", "heavy"):
            positive(key, getattr(self, key), allow_zero=True, policy=self.name)
        if not isinstance(self.window, int) or self.window < 1:
            raise PolicyError(f"policy 'vattention': window must be an integer ≥ 1 (the new token is always read), "
                              f"got {self.window!r}")
        if not isinstance(self.pilot, int) or self.pilot < 2:
            raise PolicyError(f"policy 'vattention': pilot must be an integer ≥ 2, got {self.pilot!r}")
        if self.max_sample is not None and (not isinstance(self.max_sample, int) or self.max_sample < 1):
            raise PolicyError(f"policy 'vattention': max_sample must be a positive integer or None, got "
                              f"{self.max_sample!r}")
        self.z = float(torch.special.ndtri(torch.tensor(1 - self.delta / 4, dtype=torch.float64)))
        self.eta = self.epsilon / (2 + self.epsilon)
        self.roles: list[int] | None = None

    def bind(self, manifest: Any, config: Any) -> None:
        self.roles = manifest.layer_role.tolist() if manifest is not None and manifest.layer_role is not None else None

    def role(self, layer: int) -> int | None:
        return self.roles[layer] if self.roles is not None else None

    def plan(self, step: Step) -> Plan:
        role = self.role(step.layer)
        if role == LAYER_ROLE_FULL:
            return Plan()
        b, hkv, t, d = step.key.shape
        g = step.groups
        q = step.query.float().view(b, hkv, g, d)
        scores = torch.einsum("bhgd,bhtd->bhgt", q, step.key.float()) * step.scale  # [B, Hkv, G, T]
        scores = scores.masked_fill(~step.keep[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if role == LAYER_ROLE_SELECT:
            step.scratch["vattention.scores"] = probs.amax(dim=(1, 2))  # [B, T]
        if role == LAYER_ROLE_SPARSE:
            ranked_by = step.scratch["vattention.scores"][:, None, :]  # one ranking for every KV head
        else:
            ranked_by = probs.amax(2)  # [B, Hkv, T]
        first = step.keep.float().argmax(-1)  # the first valid slot of each row
        heavy = heavy_hitters(ranked_by, first, t - 1, self.sinks, self.window, self.heavy).expand(b, hkv, -1)
        fixed = fixed_slots(first, t - 1, self.sinks, self.window, heavy)
        picked = scores.gather(-1, fixed.clamp_min(0)[:, :, None, :].expand(b, hkv, g, fixed.shape[-1]))
        picked = picked.masked_fill(fixed[:, :, None, :] < 0, float("-inf"))  # [B, Hkv, G, F]
        lse = torch.logsumexp(picked, -1)  # [B, Hkv, G]
        values = step.value.float()
        fixed_v = values.gather(2, fixed.clamp_min(0)[..., None].expand(*fixed.shape, d))
        out = torch.einsum("bhgf,bhfd->bhgd", torch.exp(picked - lse[..., None]), fixed_v)
        n_r = step.keep.sum(-1)[:, None] - (fixed >= 0).sum(-1)  # [B, Hkv]
        pilot = self.pilot_slots(n_r, fixed, first, t, step.layer)
        logits = scores.gather(-1, pilot[:, :, None, :].expand(b, hkv, g, self.pilot))  # [B, Hkv, G, p]
        pilot_v = values.gather(2, pilot[..., None].expand(*pilot.shape, d))  # [B, Hkv, p, D]
        size = self._sample_size(logits - lse[..., None], pilot_v, out, n_r)
        return self.sampled_plan(fixed, first, n_r, size, int(size.max()) if size.numel() else 0, t, step.layer)

    def pilot_slots(self, n_r: torch.Tensor, fixed: torch.Tensor, first: torch.Tensor, tokens: Any,
                    layer: Any, free: torch.Tensor | None = None, row_keys: bool = True) -> torch.Tensor:
        """``[B, Hkv, pilot]`` slots drawn uniformly from the residual (slot ``first`` where it is empty)."""
        u = token_uniforms(self.seed, PILOT, tokens, layer, (*n_r.shape, self.pilot), n_r.device, row_keys)
        ranks = (u * n_r[..., None]).long().minimum((n_r - 1).clamp_min(0)[..., None])
        return residual_slots(ranks, fixed, first, free).where(n_r[..., None] > 0, first[:, None, None])

    def sampled_plan(self, fixed: torch.Tensor, first: torch.Tensor, n_r: torch.Tensor, size: torch.Tensor,
                     width: int, tokens: Any, layer: Any, free: torch.Tensor | None = None,
                     row_keys: bool = True) -> Plan:
        """The deterministic set at weight 1, then ``size`` draws (in ``width`` places) at weight ``n_r / size``;
        where ``size`` is ``n_r`` the remaining slots in order, each once."""
        if width == 0:
            return Plan(indices=fixed, info={"sampled": 0})
        u = token_uniforms(self.seed, SAMPLE, tokens, layer, (*n_r.shape, width), n_r.device, row_keys)
        place = torch.arange(width, device=u.device)
        whole = (size >= n_r)[..., None]
        ranks = torch.where(whole, place, (u * n_r[..., None]).long()).minimum((n_r - 1).clamp_min(0)[..., None])
        take = place < size[..., None]
        drawn = torch.where(take, residual_slots(ranks, fixed, first, free), -1)
        weight = torch.log(n_r.float() / size.clamp_min(1).float())[..., None].expand_as(drawn)
        log_weights = torch.cat([torch.zeros(fixed.shape, device=u.device), torch.where(take, weight, 0.0)], -1)
        return Plan(indices=torch.cat([fixed, drawn], -1), log_weights=log_weights, info={"sampled": take.sum()})

    def _sample_size(self, logits: torch.Tensor, values: torch.Tensor, fixed_out: torch.Tensor,
                     n_r: torch.Tensor) -> torch.Tensor:
        """Draws per (row, KV head) from the pilot: ``logits [B, Hkv, G, p]`` of its draws less the deterministic
        set's log-sum-exp (at this shift that set's softmax denominator is 1 and its part of ``N`` is its
        attention output ``fixed_out [B, Hkv, G, D]``), their ``values [B, Hkv, p, D]`` and the residual's size
        ``n_r [B, Hkv]``. ``n_r`` where the bound asks for that many or more, or where ``n_r ≤ pilot``; at most
        ``max_sample``."""
        e = torch.exp(logits)  # [B, Hkv, G, p]
        x = e[..., None] * values[:, :, None]  # [B, Hkv, G, p, D]
        c = float(logits.shape[-1])
        mean_e = e.mean(-1)
        var_e = ((e - mean_e[..., None]) ** 2).sum(-1) / (c - 1)
        mean_x = x.mean(-2)
        var_x = ((x - mean_x[..., None, :]) ** 2).sum((-2, -1)) / (c - 1)  # tr Σ_N
        nr = n_r[:, :, None].float()
        d_est = 1 + nr * mean_e
        n_est = (fixed_out + nr[..., None] * mean_x).norm(dim=-1)
        b_d = (self.z * nr * var_e.sqrt() / (self.eta * d_est).clamp_min(1e-30)) ** 2
        b_n = (self.z * nr * var_x.sqrt() / (self.eta * n_est).clamp_min(1e-30)) ** 2
        need = torch.nan_to_num(torch.maximum(b_d, b_n).amax(-1), nan=math.inf, posinf=math.inf)  # [B, Hkv]
        need = need.clamp(max=float(M32)).ceil().clamp_min(1).long()
        # A residual no larger than the pilot is read whole: the pilot already cost that much.
        need = torch.where(n_r <= self.pilot, n_r, torch.minimum(need, n_r))
        return need.clamp(max=self.max_sample) if self.max_sample is not None else need

    def static_step(self, shape: Any) -> VAttentionStep:
        if self.max_sample is None:
            raise NotImplementedError("policy 'vattention' without max_sample draws a sample whose size changes per "
                                      "step; the engine runs max_sample=N")
        if self.roles is not None and len(self.roles) != shape.layers:
            raise PolicyError(f"policy 'vattention' holds {len(self.roles)} layer roles for a {shape.layers}-layer "
                              "model; bind it to a manifest of this model first")
        return VAttentionStep(self)


@dataclass
class VAttentionStep:
    """The engine's step, with the reference's functions on fixed shapes. A layer that ranks heavy hitters by
    its own scores reads every key once for them (the dense pass that keeps its logits); a Δ-layer also ranks
    by the max over all its heads and passes those slots on, so the sparse layers after it read no more than
    their deterministic set, the pilot and the sample. One attention pass over the deterministic set gives
    the statistics' shift and ``N``'s fixed part, the pilot's logits come from its gathered keys, and the last
    pass reads the deterministic set and ``max_sample`` draws, masked to the bound's size and weighted
    through the kernel's log-weights."""

    policy: VAttention
    head_order: ClassVar[None] = None
    sparse: ClassVar[bool] = True
    block_sizes: ClassVar[tuple[int, ...]] = (1,)
    # rows of their own lengths (the scheduler's): each row draws keyed by its own length, as a request alone
    row_lengths: ClassVar[bool] = True
    paged: ClassVar[bool] = True  # its attention and its pilot's keys read through the span's table

    def __post_init__(self) -> None:
        self._layer_ids: dict[Any, torch.Tensor] = {}
        self._compiled: Any = None
        self.row_keys = True  # a batch's rows draw apart; the scheduler's rows each as a request alone

    def prepare(self, dec: Any) -> None:
        self.row_keys = not dec.cache.row_lengths

    def reads(self, shape: Any, context: int) -> float:
        """Mean tokens read per (layer, KV head): every key where a layer ranks by its own scores, then the
        deterministic set, the pilot and the largest sample."""
        p = self.policy
        sparse = min(context, p.sinks + p.window + p.heavy + p.pilot + p.max_sample)
        per_layer = [context if p.role(i) == LAYER_ROLE_FULL else
                     sparse if p.role(i) == LAYER_ROLE_SPARSE else context + sparse for i in range(shape.layers)]
        return sum(per_layer) / len(per_layer)

    def attention(self, dec: Any, layer: int, q, k, v, span, state: dict) -> Any:
        p = self.policy
        role = p.role(layer)
        if role == LAYER_ROLE_FULL:
            return dec.attn.attend(q, k, v, span)
        b, hkv = q.shape[0], k.shape[1]  # k: the rows' keys, or a pool of pages (span.table)
        first, last = span.first, span.last
        if role == LAYER_ROLE_SPARSE:  # the deterministic set the nearest Δ-layer chose, the same for every head
            fixed, free = (x.expand(b, hkv, -1) for x in state["vattention.fixed"])
        else:
            _, own = dec.attn.attend_and_score(q, k, v, span, 1, per_kv_head=True)  # [B, Hkv, T]: max over the group
            fixed = fixed_slots(first, last, p.sinks, p.window, heavy_hitters(own, first, last, p.sinks, p.window,
                                                                              p.heavy))
            free = free_before(fixed, first)
            if role == LAYER_ROLE_SELECT:  # the sparse layers after it rank by the max over all heads
                shared = fixed_slots(first, last, p.sinks, p.window, heavy_hitters(own.amax(1, keepdim=True), first,
                                                                                   last, p.sinks, p.window, p.heavy))
                state["vattention.fixed"] = (shared, free_before(shared, first))
        out, lse = dec.attn.attend(q, k, v, span, fixed, 1, with_lse=True)  # [B, Hq, D], [B, Hq]
        if k.device not in self._layer_ids:  # once, in the eager warm-up before any graph capture
            self._layer_ids[k.device] = torch.arange(dec.shape.layers, device=k.device)
        sample = self._sample(dec)
        indices, log_weights = sample(q, k, v, fixed, free, first, last, out, lse, self._layer_ids[k.device][layer],
                                      dec.shape.attention_scale, span.table, span.slots(k))
        return dec.attn.attend(q, k, v, span, indices, 1, log_weights=log_weights)

    def _sample(self, dec: Any) -> Any:
        """:meth:`draw_sample`, as the decoder compiles it (:meth:`StaticDecoder.compiled`: its small ops fuse
        into a few kernels; the layer is a device scalar, so one graph serves every layer)."""
        if self._compiled is None:
            self._compiled = dec.compiled(self.draw_sample)
        return self._compiled

    def draw_sample(self, q, k, v, fixed, free, first, last, out, lse, layer, scale: float, table=None,
                    slots: int | None = None):
        """The pilot, the bound's sample size and the draws: ``(indices, log_weights)`` of the last pass. ``table``:
        the keys are a pool of pages read through it (``slots``: a row's slots, then)."""
        p = self.policy
        b, hkv, d = q.shape[0], k.shape[1], k.shape[3]
        t = k.shape[2] if slots is None else slots
        g = q.shape[1] // hkv
        n_r = (last - first + 1)[:, None] - (fixed >= 0).sum(-1)  # [B, Hkv]
        tokens = last + 1
        pilot = p.pilot_slots(n_r, fixed, first, tokens, layer, free, self.row_keys)  # [B, Hkv, p]
        keys, values = gather_tokens(k, pilot, table).float(), gather_tokens(v, pilot, table).float()  # [B, Hkv, p, D]
        # a product and a sum, not a matmul: exact float32 (no TF32) for the few pilot keys
        logits = (q.float().view(b, hkv, g, 1, d) * keys[:, :, None]).sum(-1) * scale  # [B, Hkv, G, p]
        size = p._sample_size(logits - lse.view(b, hkv, g)[..., None], values, out.float().view(b, hkv, g, d), n_r)
        plan = p.sampled_plan(fixed, first, n_r, size, min(t, p.max_sample), tokens, layer, free, self.row_keys)
        return plan.indices, plan.log_weights
