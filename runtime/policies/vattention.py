"""``vattention``: vAttention (ICLR 2026) — sparse attention with a verified error bound, per KV head.

Each head reads a deterministic set — ``sinks`` first tokens, the last ``window`` tokens and the ``heavy``
tokens of highest attention — plus a uniform sample without replacement of the ``n_r`` remaining tokens,
each sampled token weighted by ``n_r / b``. The sample size ``b`` comes from the central limit theorem
(the paper's Algorithm 2): a pilot sample estimates the spread of the residual terms of the softmax
numerator ``N = Σ e^{s_i} v_i`` and denominator ``D = Σ e^{s_i}``; with ``η = ε / (2 + ε)``,

    b_D = (z · n_r · σ_D / (η · D))²,   b_N = (z · n_r · sqrt(tr Σ_N) / (η · ‖N‖))²,   b = max(b_N, b_D)

where ``z = Φ⁻¹(1 − δ/4)``. If ``|D̂ − D| ≤ ηD`` and ``‖N̂ − N‖ ≤ η‖N‖`` then the output ``N̂/D̂`` is within
relative error ``2η / (1 − η) = ε``; each bound fails with probability ≤ δ/2. One sample serves the query
heads of a KV head, so ``b`` is the max over them.

Heavy hitters use exact scores; with a DELTA manifest (``layers.role``) full layers stay dense, Δ-layers
publish ``max_h p_h[t]`` and the sparse layers after them rank heavy hitters by it (DELTA + vAttention).

The shift of the softmax cancels in ``b``; both paths take the deterministic set's own log-sum-exp, so the
statistics are those of an attention pass over that set plus the pilot's logits. Draws come from a hash of
``(seed, tokens so far, layer, row, KV head, slot)`` (:func:`token_uniforms`), so the transformers path, the
engine's graph-captured step and any device draw the same sample. ``max_sample`` caps ``b`` (then the bound
is no longer guaranteed where the cap binds); the engine needs it, since its shapes are fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from runtime.engine.sampling import M32, mix32
from runtime.kernels.topk_select import mask_to_indices
from runtime.manifest import LAYER_ROLE_FULL, LAYER_ROLE_SELECT, LAYER_ROLE_SPARSE
from runtime.policies import Plan, PolicyError, Step, positive

PILOT, SAMPLE = 0, 1  # the two draws of a step: the pilot and the sample


def token_uniforms(seed: int, stream: int, tokens: torch.Tensor | int, layer: int, shape: tuple[int, int, int],
                   device: Any) -> torch.Tensor:
    """Uniforms in (0, 1) ``[B, Hkv, T]`` from a hash of (seed, stream, tokens so far, layer, row, KV head, slot);
    ``tokens`` may be a device scalar (the engine's length)."""
    b, hkv, t = shape
    h = mix32((torch.as_tensor(tokens, device=device).long() * 0x2545F491 + seed) & M32)
    h = mix32(h ^ ((layer * 0x9E3779B + stream * 0x632BE5AB) & M32))
    h = mix32(h ^ (torch.arange(b, device=device, dtype=torch.long)[:, None, None] * 0x85EBCA6B & M32))
    h = mix32(h ^ (torch.arange(hkv, device=device, dtype=torch.long)[None, :, None] * 0xC2B2AE35 & M32))
    h = mix32(h ^ torch.arange(t, device=device, dtype=torch.long)[None, None, :])
    return (h.float() + 0.5) / 4294967296.0


def draw(uniforms: torch.Tensor, pool: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` slots drawn uniformly without replacement from ``pool`` ``[B, Hkv, T]`` (the smallest
    uniforms), and whether each draw exists (rows with fewer than ``count`` members)."""
    keys = uniforms.masked_fill(~pool, 2.0)
    drawn = keys.topk(min(count, pool.shape[-1]), dim=-1, largest=False)
    return drawn.indices, drawn.values < 2.0


def deterministic_set(valid: torch.Tensor, heavy_scores: torch.Tensor, first: torch.Tensor, last: torch.Tensor | int,
                      sinks: int, window: int, heavy: int) -> torch.Tensor:
    """``[B, Hkv, T]`` bool: the ``sinks`` first valid slots (from ``first [B]``), the slots of the last
    ``window`` tokens (up to ``last``) and the ``heavy`` valid others of highest ``heavy_scores``."""
    slot = torch.arange(valid.shape[-1], device=valid.device)
    fixed = valid & ((slot < (first[:, None, None] + sinks)) | (slot > last - window))
    if heavy:
        ranked = heavy_scores.masked_fill(fixed | ~valid, float("-inf")).topk(min(heavy, valid.shape[-1]), dim=-1)
        fixed = fixed | torch.zeros_like(fixed).scatter(-1, ranked.indices, ranked.values > float("-inf"))
    return fixed


@dataclass
class VAttention:
    epsilon: float = 0.05  # target relative error of each head's output
    delta: float = 0.05  # allowed failure probability
    sinks: int = 4
    window: int = 64  # ≥ 1: the new token is always read
    heavy: int = 64  # top-k heavy hitters per KV head
    pilot: int = 64  # pilot sample that estimates the residual's spread
    max_sample: int | None = None  # cap on the sample per KV head (None: the bound's size; the engine needs one)
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
        valid = step.keep[:, None, :].expand(b, hkv, t)  # [B, Hkv, T]
        scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if role == LAYER_ROLE_SELECT:
            step.scratch["vattention.scores"] = probs.amax(dim=(1, 2))  # [B, T]
        if role == LAYER_ROLE_SPARSE:
            heavy_scores = step.scratch["vattention.scores"][:, None, :].expand(b, hkv, t)
        else:
            heavy_scores = probs.amax(2)
        first = step.keep.float().argmax(-1)  # the first valid slot of each row
        fixed = deterministic_set(valid, heavy_scores, first, t - 1, self.sinks, self.window, self.heavy)
        masked = scores.masked_fill(~fixed[:, :, None, :], float("-inf"))
        lse = torch.logsumexp(masked, -1)  # [B, Hkv, G]
        out = torch.einsum("bhgt,bhtd->bhgd", torch.exp(masked - lse[..., None]), step.value.float())
        residual = valid & ~fixed
        pilot, exists = draw(token_uniforms(self.seed, PILOT, t, step.layer, residual.shape, residual.device),
                             residual, self.pilot)
        logits = scores.gather(-1, pilot[:, :, None, :].expand(b, hkv, g, pilot.shape[-1]))  # [B, Hkv, G, p]
        values = step.value.float().gather(2, pilot[..., None].expand(*pilot.shape, d))  # [B, Hkv, p, D]
        n_r = residual.sum(-1)  # [B, Hkv]
        size = self._sample_size(logits - lse[..., None], values, exists, out, n_r)
        width = int(size.max()) if size.numel() else 0
        return self._with_sample(mask_to_indices(fixed), residual, size, width, t, step.layer)

    def _with_sample(self, fixed_ids: torch.Tensor, residual: torch.Tensor, size: torch.Tensor, width: int,
                     tokens: Any, layer: int) -> Plan:
        """The plan: the deterministic set at weight 1, then ``size`` of the residual's slots (drawn in
        ``width`` places) at weight ``n_r / size``."""
        if width == 0:
            return Plan(indices=fixed_ids, info={"sampled": 0})
        n_r = residual.sum(-1)
        drawn, exists = draw(token_uniforms(self.seed, SAMPLE, tokens, layer, residual.shape, residual.device),
                             residual, width)
        take = exists & (torch.arange(drawn.shape[-1], device=drawn.device) < size[..., None])
        weight = torch.log(n_r.float() / size.clamp_min(1).float())[..., None].expand_as(drawn)
        indices = torch.cat([fixed_ids, torch.where(take, drawn, -1)], dim=-1)
        log_weights = torch.cat([torch.zeros(fixed_ids.shape, device=weight.device), torch.where(take, weight, 0.0)], -1)
        return Plan(indices=indices, log_weights=log_weights, info={"sampled": take.sum()})

    def _sample_size(self, logits: torch.Tensor, values: torch.Tensor, exists: torch.Tensor, fixed_out: torch.Tensor,
                     n_r: torch.Tensor) -> torch.Tensor:
        """Residual slots to sample per (row, KV head), from a pilot sample: ``logits [B, Hkv, G, p]`` of the
        pilot's slots less the deterministic set's log-sum-exp, their ``values [B, Hkv, p, D]``, ``exists
        [B, Hkv, p]``, the deterministic set's output ``fixed_out [B, Hkv, G, D]`` and the residual's size
        ``n_r [B, Hkv]``. At most ``n_r`` (then the residual is read whole, at weight 1) and ``max_sample``."""
        w = exists[:, :, None, :].float()
        e = torch.exp(logits) * w  # [B, Hkv, G, p]; the deterministic set's denominator is 1 at this shift
        x = e[..., None] * values[:, :, None]  # [B, Hkv, G, p, D]
        c = exists.sum(-1).clamp_min(2).float()[:, :, None]  # [B, Hkv, 1]
        mean_e = e.sum(-1) / c
        var_e = ((e - mean_e[..., None]) ** 2 * w).sum(-1) / (c - 1)
        mean_x = x.sum(-2) / c[..., None]
        var_x = (((x - mean_x[..., None, :]) ** 2) * w[..., None]).sum((-2, -1)) / (c - 1)  # tr Σ_N
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
    """The engine's step, with the reference's arithmetic on fixed shapes: a layer that ranks heavy hitters by
    its own scores reads every key once for them (the dense pass that keeps its logits; a Δ-layer publishes
    their max over all heads), a sparse layer of a DELTA manifest takes the published ones; then one
    attention pass over the deterministic set gives the statistics' shift and ``N``, the pilot's logits come
    from its gathered keys, and the final pass reads the deterministic set and ``max_sample`` draws, masked to
    the bound's size, weighted through the kernel's log-weights."""

    policy: VAttention
    head_order: ClassVar[None] = None
    sparse: ClassVar[bool] = True
    block_sizes: ClassVar[tuple[int, ...]] = (1,)

    def reads(self, shape: Any, context: int) -> float:
        """Mean tokens read per (layer, KV head): every key for the scores where a layer ranks by its own, then
        the deterministic set and the largest sample (the values of a sparse read)."""
        p = self.policy
        sparse = min(context, p.sinks + p.window + p.heavy + p.pilot + p.max_sample)
        per_layer = [context if p.role(i) == LAYER_ROLE_FULL else
                     sparse if p.role(i) == LAYER_ROLE_SPARSE else context + sparse for i in range(shape.layers)]
        return sum(per_layer) / len(per_layer)

    def attention(self, dec: Any, layer: int, q, k, v, span, state: dict) -> Any:
        p = self.policy
        role = p.role(layer)
        if role == LAYER_ROLE_FULL:
            return dec.attend(q, k, v, span)
        b, hkv, t, d = k.shape
        g = q.shape[1] // hkv
        slot = torch.arange(t, device=k.device)
        valid = ((slot >= span.first[:, None]) & (slot <= span.last))[:, None, :].expand(b, hkv, t)
        if role == LAYER_ROLE_SPARSE:
            heavy_scores = state["vattention.scores"][:, None, :].expand(b, hkv, t)
        else:
            _, heavy_scores = dec.attend_and_score(q, k, v, span, 1, per_kv_head=True)  # [B, Hkv, T]
            if role == LAYER_ROLE_SELECT:
                state["vattention.scores"] = heavy_scores.amax(1)
        fixed = deterministic_set(valid, heavy_scores, span.first, span.last, p.sinks, p.window, p.heavy)
        fixed_ids = mask_to_indices(fixed, min(t, p.sinks + p.window + p.heavy))
        out, lse = dec.attend(q, k, v, span, fixed_ids, 1, with_lse=True)  # [B, Hq, D], [B, Hq]
        residual = valid & ~fixed
        tokens = span.last + 1
        pilot, exists = draw(token_uniforms(p.seed, PILOT, tokens, layer, residual.shape, k.device), residual,
                             p.pilot)  # [B, Hkv, p]
        index = pilot[..., None].expand(*pilot.shape, d)
        keys, values = k.gather(2, index).float(), v.gather(2, index).float()  # [B, Hkv, p, D]
        logits = torch.einsum("bhgd,bhpd->bhgp", q.float().view(b, hkv, g, d), keys) * dec.shape.attention_scale
        lse = lse.view(b, hkv, g)
        size = p._sample_size(logits - lse[..., None], values, exists, out.float().view(b, hkv, g, d),
                              residual.sum(-1))
        plan = p._with_sample(fixed_ids, residual, size, min(t, p.max_sample), tokens, layer)
        return dec.attend(q, k, v, span, plan.indices, 1, log_weights=plan.log_weights)
