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
publish ``max_h p_h[t]`` and the sparse layers after them rank heavy hitters by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from runtime.kernels.topk_select import mask_to_indices
from runtime.manifest import LAYER_ROLE_FULL, LAYER_ROLE_SELECT
from runtime.policies import Plan, PolicyError, Step, positive


@dataclass
class VAttention:
    epsilon: float = 0.05  # target relative error of each head's output
    delta: float = 0.05  # allowed failure probability
    sinks: int = 4
    window: int = 64
    heavy: int = 64  # top-k heavy hitters per KV head
    pilot: int = 64  # pilot sample that estimates the residual's spread
    seed: int = 0
    name: ClassVar[str] = "vattention"

    def __post_init__(self) -> None:
        for key in ("epsilon", "delta"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not 0 < value < 1:
                raise PolicyError(f"policy 'vattention': {key} must be in (0, 1), got {value!r}")
        for key in ("sinks", "window", "heavy"):
            positive(key, getattr(self, key), allow_zero=True, policy=self.name)
        if not isinstance(self.pilot, int) or self.pilot < 2:
            raise PolicyError(f"policy 'vattention': pilot must be an integer ≥ 2, got {self.pilot!r}")
        self.z = float(torch.special.ndtri(torch.tensor(1 - self.delta / 4, dtype=torch.float64)))
        self.eta = self.epsilon / (2 + self.epsilon)
        self.roles: list[int] | None = None
        self._generators: dict[str, torch.Generator] = {}

    def bind(self, manifest: Any, config: Any) -> None:
        self.roles = manifest.layer_role.tolist() if manifest is not None and manifest.layer_role is not None else None

    def reset(self) -> None:
        self._generators.clear()  # same seed, same samples, for every request

    def _rand(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        gen = self._generators.get(str(device))
        if gen is None:
            gen = self._generators[str(device)] = torch.Generator(device=device).manual_seed(self.seed)
        return torch.rand(shape, generator=gen, device=device)

    def _uniform(self, pool: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` ids drawn uniformly without replacement from ``pool`` ``[B, Hkv, T]`` per row, in random
        order, and whether each draw exists (rows with fewer than ``count`` members)."""
        keys = self._rand(pool.shape, pool.device).masked_fill(~pool, 2.0)
        drawn = keys.topk(min(count, pool.shape[-1]), dim=-1, largest=False)
        return drawn.indices, drawn.values < 2.0

    def plan(self, step: Step) -> Plan:
        role = self.roles[step.layer] if self.roles is not None else None
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
        inherited = step.scratch.get("vattention.scores") if role is not None and role != LAYER_ROLE_SELECT else None
        heavy_scores = inherited[:, None, :].expand(b, hkv, t) if inherited is not None else probs.amax(2)

        # Deterministic set: sinks, local window, heavy hitters.
        position = torch.arange(t, device=step.key.device)
        fixed = valid & ((valid.cumsum(-1) <= self.sinks) | (position >= t - self.window))
        if self.heavy:
            ranked = heavy_scores.masked_fill(fixed | ~valid, float("-inf")).topk(min(self.heavy, t), dim=-1)
            fixed = fixed.scatter(-1, ranked.indices, ranked.values > float("-inf")) | fixed
        residual = valid & ~fixed
        n_r = residual.sum(-1)  # [B, Hkv]
        sample_size = self._sample_size(scores, step.value.float(), fixed, residual, n_r)  # [B, Hkv]
        exact = sample_size >= n_r
        fixed = fixed | (residual & exact[..., None])
        fixed_ids = mask_to_indices(fixed)
        most = int(torch.where(exact, 0, sample_size).max()) if n_r.numel() else 0
        if most == 0:
            return Plan(indices=fixed_ids, info={"sampled": 0})
        drawn, exists = self._uniform(residual & ~exact[..., None], most)
        take = exists & (torch.arange(most, device=drawn.device) < sample_size[..., None])
        weight = torch.log(n_r.float() / sample_size.clamp_min(1).float())[..., None].expand_as(drawn)
        indices = torch.cat([fixed_ids, torch.where(take, drawn, -1)], dim=-1)
        log_weights = torch.cat([torch.zeros(fixed_ids.shape, device=weight.device), torch.where(take, weight, 0.0)], -1)
        return Plan(indices=indices, log_weights=log_weights, info={"sampled": int(take.sum())})

    def _sample_size(self, scores: torch.Tensor, value: torch.Tensor, fixed: torch.Tensor, residual: torch.Tensor,
                     n_r: torch.Tensor) -> torch.Tensor:
        """The CLT sample size per (batch, KV head) from a pilot sample of the residual."""
        b, hkv, g, t = scores.shape
        exp = torch.exp(scores - scores.amax(-1, keepdim=True))  # [B, Hkv, G, T]; the shift cancels in b
        exp = torch.nan_to_num(exp, nan=0.0)
        d_fixed = (exp * fixed[:, :, None]).sum(-1)  # [B, Hkv, G]
        n_fixed = torch.einsum("bhgt,bhtd->bhgd", exp * fixed[:, :, None], value)  # [B, Hkv, G, D]
        pilot, exists = self._uniform(residual, self.pilot)  # [B, Hkv, p]
        count = exists.sum(-1).clamp_min(2).float()  # [B, Hkv]
        w = exists[:, :, None, :].float()
        e = exp.gather(-1, pilot[:, :, None, :].expand(b, hkv, g, pilot.shape[-1])) * w  # [B, Hkv, G, p]
        v = value.gather(2, pilot[..., None].expand(*pilot.shape, value.shape[-1]))  # [B, Hkv, p, D]
        x = e[..., None] * v[:, :, None]  # [B, Hkv, G, p, D]
        c = count[:, :, None]
        mean_e = e.sum(-1) / c
        var_e = ((e - mean_e[..., None]) ** 2 * w).sum(-1) / (c - 1)
        mean_x = x.sum(-2) / c[..., None]
        var_x = (((x - mean_x[..., None, :]) ** 2) * w[..., None]).sum((-2, -1)) / (c - 1)  # tr Σ_N
        nr = n_r[:, :, None].float()
        d_est = d_fixed + nr * mean_e
        n_est = (n_fixed + nr[..., None] * mean_x).norm(dim=-1)
        b_d = (self.z * nr * var_e.sqrt() / (self.eta * d_est).clamp_min(1e-30)) ** 2
        b_n = (self.z * nr * var_x.sqrt() / (self.eta * n_est).clamp_min(1e-30)) ** 2
        need = torch.maximum(b_d, b_n).amax(-1)  # [B, Hkv]
        need = torch.nan_to_num(need, nan=math.inf, posinf=math.inf).clamp(max=float(t))
        # A residual no larger than the pilot is read whole: the pilot already cost that much.
        need = torch.where(n_r <= self.pilot, n_r.float(), need.ceil().clamp_min(1))
        return need.long()
