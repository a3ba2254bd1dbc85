"""Gate distributions for head roles: ``HardKuma`` (LycheeDecode), ``HardConcrete`` (Louizos et al.) and
``Sigmoid`` (a DuoAttention-style deterministic gate), behind one interface, found by name in ``GATES``.

Every gate holds tensors of any shape (one entry per gated head) and offers

- ``rsample(sample_shape=(), generator=None)``: a reparameterised draw of z in [0, 1],
- ``prob_zero()`` / ``prob_one()``: P(z = 0), P(z = 1) per gate,
- ``expected_gate()``: E[z] per gate,
- ``expected_l0()``: a scalar, the sum over gates of P(z != 0) (the quantity the Lagrangian constrains).

The stochastic gates stretch a variable s in (0, 1) to (low, high) with low < 0 < 1 < high and clamp to
[0, 1], so z is exactly 0 or exactly 1 with positive probability. All arithmetic runs in float64 and in log
space, so parameters from 1e-3 to 1e3 give finite values and finite gradients; results come back in the
dtype of the parameters.

``expected_gate`` uses quadrature, not a closed form (HardKuma's closed form needs the incomplete beta
function, which torch cannot differentiate): E[z] = ∫_0^1 P(z > x) dx = (high − low) ∫ (1 − F(s)) ds over
the s range that the stretch maps into (0, 1). The survival function 1 − F is bounded, monotone and smooth
there, and composite Gauss–Legendre with 4 × 32 nodes agrees with 40-digit adaptive quadrature to 1e-15
for α, β from 1e-3 to 1e3 (the tests compare with scipy's incomplete beta).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from rolecall.core.registry import Registry

GATES = Registry("gate")

_PANELS, _NODES = 4, 32
_NODES_X, _NODES_W = (torch.from_numpy(a) for a in np.polynomial.legendre.leggauss(_NODES))
_TINY = 1e-300  # keeps float64 logs finite


def register(name: str):
    def deco(cls):
        cls.name = name
        return GATES.register(name)(cls)

    return deco


def get_gate(name: str) -> type:
    return GATES.lookup(name)


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (Mächler's switch at -log 2)."""
    x = x.clamp(max=-_TINY)
    near = torch.log(-torch.expm1(x.clamp(min=-math.log(2))))
    far = torch.log1p(-torch.exp(x.clamp(max=-math.log(2))))
    return torch.where(x > -math.log(2), near, far)


def _as64(x) -> Tensor:
    return torch.as_tensor(x).to(torch.float64)


def _check_stretch(low: float, high: float) -> None:
    if not (low < 0.0 and high > 1.0):
        raise ValueError(f"the stretch interval must satisfy low < 0 < 1 < high, got ({low}, {high})")


def _uniform(shape: torch.Size, like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Uniform draws in (0, 1) from ``generator`` (on its own device), moved to ``like``'s device."""
    device = generator.device if generator is not None else like.device
    u = torch.rand(shape, generator=generator, dtype=torch.float64, device=device)
    return u.to(like.device).clamp(1e-12, 1 - 1e-12)


def _survival_integral(low: float, high: float, log_survival) -> Tensor:
    """E[z] = ∫_0^1 P(z > x) dx = (high − low) ∫_{t0}^{t1} (1 − F(s)) ds, composite Gauss–Legendre in s.

    ``log_survival`` maps s [N] to log(1 − F(s)) [..., N]; t0, t1 are where the stretch crosses 0 and 1.
    """
    t0, t1 = -low / (high - low), (1 - low) / (high - low)
    edges = torch.linspace(t0, t1, _PANELS + 1, dtype=torch.float64)
    s = torch.cat([a + (b - a) * (_NODES_X + 1) / 2 for a, b in zip(edges[:-1], edges[1:])])  # [P * N]
    w = torch.cat([(b - a) / 2 * _NODES_W for a, b in zip(edges[:-1], edges[1:])])
    log_surv = log_survival(s)
    return (high - low) * (torch.exp(log_surv) * w.to(log_surv.device)).sum(-1)


@register("hardkuma")
@dataclass
class HardKuma:
    """Stretched and clamped Kumaraswamy(α, β): s = (1 − u^{1/β})^{1/α}, z = clamp(low + (high − low) s, 0, 1)."""

    alpha: Tensor
    beta: Tensor
    low: float = -0.1
    high: float = 1.1

    def __post_init__(self):
        _check_stretch(self.low, self.high)
        self.alpha, self.beta = torch.as_tensor(self.alpha), torch.as_tensor(self.beta)
        if not bool(((self.alpha > 0) & (self.beta > 0)).all()):
            raise ValueError("HardKuma needs alpha > 0 and beta > 0; store them as logs (GateParameters does)")
        self.shape = torch.broadcast_shapes(self.alpha.shape, self.beta.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.alpha.dtype if self.alpha.is_floating_point() else torch.float32

    def _t(self, x: float) -> float:
        return (x - self.low) / (self.high - self.low)

    def log_survival(self, x) -> Tensor:
        """log(1 − F(x)) = β log(1 − x^α) of the unstretched Kumaraswamy, x in (0, 1)."""
        a, b = _as64(self.alpha), _as64(self.beta)
        return b * log1mexp(a * torch.log(_as64(x).clamp(min=_TINY)))

    def cdf(self, x) -> Tensor:
        return -torch.expm1(self.log_survival(x))

    def prob_zero(self) -> Tensor:
        return self.cdf(self._t(0.0)).to(self.dtype)

    def prob_one(self) -> Tensor:
        return torch.exp(self.log_survival(self._t(1.0))).to(self.dtype)

    def rsample(self, sample_shape=(), generator: torch.Generator | None = None) -> Tensor:
        a, b = _as64(self.alpha), _as64(self.beta)
        u = _uniform(torch.Size(sample_shape) + self.shape, a, generator)
        s = torch.exp(log1mexp(torch.log(u) / b) / a)
        return (self.low + (self.high - self.low) * s).clamp(0, 1).to(self.dtype)

    def expected_gate(self) -> Tensor:
        a = _as64(self.alpha).expand(self.shape)[..., None]
        b = _as64(self.beta).expand(self.shape)[..., None]
        return _survival_integral(self.low, self.high,
                                  lambda s: b * log1mexp(a * torch.log(s.to(a.device)))).to(self.dtype)

    def l0_terms(self) -> Tensor:
        """Each gate's share of E[‖z‖₀]: P(z ≠ 0)."""
        return 1 - self.prob_zero()

    def expected_l0(self) -> Tensor:
        return self.l0_terms().sum()

    def manifest_params(self) -> tuple[Tensor, Tensor]:
        return self.alpha, self.beta


@register("hardconcrete")
@dataclass
class HardConcrete:
    """Hard concrete (Louizos et al. 2018): s = σ((logit u + log α) / β), stretched and clamped like HardKuma."""

    log_alpha: Tensor
    beta: float = 2.0 / 3.0  # temperature
    low: float = -0.1
    high: float = 1.1

    def __post_init__(self):
        _check_stretch(self.low, self.high)
        self.log_alpha = torch.as_tensor(self.log_alpha)
        if not self.beta > 0:
            raise ValueError(f"HardConcrete needs a positive temperature beta, got {self.beta}")
        self.shape = self.log_alpha.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.log_alpha.dtype if self.log_alpha.is_floating_point() else torch.float32

    def _t(self, x: float) -> float:
        return (x - self.low) / (self.high - self.low)

    def cdf(self, x: float) -> Tensor:
        """P(s <= x) = σ(β logit x − log α)."""
        return torch.sigmoid(self.beta * math.log(x / (1 - x)) - _as64(self.log_alpha))

    def prob_zero(self) -> Tensor:
        return self.cdf(self._t(0.0)).to(self.dtype)

    def prob_one(self) -> Tensor:
        return (1 - self.cdf(self._t(1.0))).to(self.dtype)

    def rsample(self, sample_shape=(), generator: torch.Generator | None = None) -> Tensor:
        la = _as64(self.log_alpha)
        u = _uniform(torch.Size(sample_shape) + self.shape, la, generator)
        s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + la) / self.beta)
        return (self.low + (self.high - self.low) * s).clamp(0, 1).to(self.dtype)

    def expected_gate(self) -> Tensor:
        la = _as64(self.log_alpha)[..., None]
        # log(1 − F(s)) = log σ(log α − β logit s)
        return _survival_integral(self.low, self.high, lambda s: torch.nn.functional.logsigmoid(
            la - self.beta * (torch.log(s) - torch.log1p(-s)).to(la.device))).to(self.dtype)

    def l0_terms(self) -> Tensor:
        """Each gate's share of E[‖z‖₀]: P(z ≠ 0)."""
        return 1 - self.prob_zero()

    def expected_l0(self) -> Tensor:
        return self.l0_terms().sum()

    def manifest_params(self) -> tuple[Tensor, Tensor]:
        return self.log_alpha.exp(), torch.full_like(self.log_alpha, self.beta)


@register("sigmoid")
@dataclass
class Sigmoid:
    """Deterministic gate z = clamp(low + (high − low) σ(logit), 0, 1), as in DuoAttention's direct optimisation.

    There is no distribution: ``rsample`` returns z, ``prob_zero``/``prob_one`` are indicators (no gradient),
    and ``expected_l0`` is the L1 relaxation Σ z, because Σ 1[z ≠ 0] has no gradient. The clamp lets gates
    reach exactly 0 and 1 while σ keeps the gradient alive everywhere inside.
    """

    logit: Tensor
    low: float = -0.1
    high: float = 1.1

    def __post_init__(self):
        _check_stretch(self.low, self.high)
        self.logit = torch.as_tensor(self.logit)
        self.shape = self.logit.shape

    def value(self) -> Tensor:
        return (self.low + (self.high - self.low) * torch.sigmoid(self.logit)).clamp(0, 1)

    def rsample(self, sample_shape=(), generator: torch.Generator | None = None) -> Tensor:
        return self.value().expand(torch.Size(sample_shape) + self.shape)

    def prob_zero(self) -> Tensor:
        return (self.value() == 0).to(self.logit.dtype)

    def prob_one(self) -> Tensor:
        return (self.value() == 1).to(self.logit.dtype)

    def expected_gate(self) -> Tensor:
        return self.value()

    def l0_terms(self) -> Tensor:
        """Each gate's share of the penalty: z itself (the L1 relaxation; 1[z ≠ 0] has no gradient)."""
        return self.value()

    def expected_l0(self) -> Tensor:
        return self.l0_terms().sum()

    def manifest_params(self) -> tuple[Tensor, Tensor]:
        return self.value(), torch.ones_like(self.logit)


# raw trainable parameters of each gate (all zeros at the start) and how they map to the gate
_PARAMS = {
    "hardkuma": (("log_alpha", "log_beta"), lambda p, lo, hi: HardKuma(p["log_alpha"].exp(), p["log_beta"].exp(), lo, hi)),
    "hardconcrete": (("log_alpha",), lambda p, lo, hi: HardConcrete(p["log_alpha"], low=lo, high=hi)),
    "sigmoid": (("logit",), lambda p, lo, hi: Sigmoid(p["logit"], lo, hi)),
}


@dataclass
class FixedOpen:
    """A gate distribution with some gates held at z = 1 (``open`` bool, the gates' shape).

    Held gates are not learned: they draw 1, have E[z] = 1, P(z = 1) = 1, and add nothing to E[L0], so the
    Lagrangian constrains only the others (the sliding-window layers of a hybrid model, whose student
    attention must equal the teacher's). ``manifest_params`` passes the inner parameters through.
    """

    inner: object
    open: Tensor

    def __getattr__(self, name: str):  # low, high, shape, dtype, ... of the inner gate
        if name in ("inner", "open"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _hold(self, x: Tensor, value: float) -> Tensor:
        return torch.where(self.open.to(x.device), torch.full_like(x, value), x)

    def rsample(self, sample_shape=(), generator: torch.Generator | None = None) -> Tensor:
        return self._hold(self.inner.rsample(sample_shape, generator=generator), 1.0)

    def prob_zero(self) -> Tensor:
        return self._hold(self.inner.prob_zero(), 0.0)

    def prob_one(self) -> Tensor:
        return self._hold(self.inner.prob_one(), 1.0)

    def expected_gate(self) -> Tensor:
        return self._hold(self.inner.expected_gate(), 1.0)

    def expected_l0(self) -> Tensor:
        terms = self.inner.l0_terms()
        return terms.masked_fill(self.open.to(terms.device), 0.0).sum()

    def manifest_params(self) -> tuple[Tensor, Tensor]:
        return self.inner.manifest_params()


class GateParameters(nn.Module):
    """The trainable parameters of one gate per (layer, KV head), stored unconstrained (logs, logits).

    All start at zero: α = β = 1 for HardKuma, log α = 0 for HardConcrete, σ = 0.5 for Sigmoid.
    ``fixed_open`` (bool, ``shape``): gates held at z = 1 and left out of E[L0] (see :class:`FixedOpen`).
    """

    def __init__(self, kind: str, shape: tuple[int, ...], low: float = -0.1, high: float = 1.1,
                 fixed_open: Tensor | None = None):
        super().__init__()
        get_gate(kind)
        _check_stretch(low, high)
        self.kind, self.low, self.high = kind, low, high
        names, self._build = _PARAMS[kind]
        self.params = nn.ParameterDict({n: nn.Parameter(torch.zeros(shape)) for n in names})
        if fixed_open is not None and tuple(fixed_open.shape) != tuple(shape):
            raise ValueError(f"fixed_open has shape {tuple(fixed_open.shape)}, expected the gates' {tuple(shape)}")
        # not persistent: checkpoints keep only what is learned, and stay loadable either way
        held = fixed_open.bool() if fixed_open is not None and bool(fixed_open.any()) else None
        self.register_buffer("fixed_open", held, persistent=False)

    def distribution(self):
        gate = self._build(dict(self.params.items()), self.low, self.high)
        return FixedOpen(gate, self.fixed_open) if self.fixed_open is not None else gate

    def l0_goal(self, target: float, min_prob: float) -> float:
        """The value of ``expected_l0()`` that means ``target`` open gates while :meth:`constrain_` bounds every
        gate's P(z = 0) to [min_prob, 1 − min_prob].

        Under that bound a gate that is fully open still counts 1 − min_prob toward E[L0], and one that is fully
        closed still counts min_prob, so ``target`` decided gates give E[L0] = target (1 − 2p) + n p over the n
        learned gates, not ``target``. Constraining E[L0] to ``target`` itself would keep the multiplier rising
        with the right number of gates open (by n p − 2p target: 0.71 for 87 gates, a target of 8 and p = 0.01)
        until it forced a good gate shut. The Sigmoid gate has no probabilities (its E[L0] is Σ z, which may
        reach 0 and 1), so its goal is the target.
        """
        if self.kind == "sigmoid" or min_prob == 0.0:
            return float(target)
        gates = next(iter(self.params.values())).numel()
        learned = gates - (int(self.fixed_open.sum()) if self.fixed_open is not None else 0)
        return float(target) * (1 - 2 * min_prob) + learned * min_prob

    @torch.no_grad()
    def clamp_(self, bound: float = math.log(1e3)) -> None:
        """Keep raw parameters in [−bound, bound] (α, β in [1e-3, 1e3] for HardKuma, the range the closed
        forms are tested on). Adam takes full-size steps on tiny gradients of constant sign, so a saturated
        gate would otherwise drift without limit and never come back."""
        for p in self.params.values():
            p.clamp_(-bound, bound)

    @torch.no_grad()
    def constrain_(self, min_prob: float = 0.0, bound: float = math.log(1e3)) -> None:
        """Project the parameters after an optimizer step: :meth:`clamp_`, then keep every gate's P(z = 0) in
        [min_prob, 1 − min_prob].

        A gate that is certain (P(z = 0) ≈ 0 or ≈ 1) has no gradient left: its samples sit at the clamp, where
        the distillation loss cannot reach it, and ∂P(z ≠ 0)/∂θ ≈ 0, where the multiplier cannot either, so
        λ can grow without limit and still not close it. The bound keeps both levers alive at the cost of at
        most ``min_prob`` of E[L0] per gate. It is the analogue of Louizos et al.'s clamp of log α to
        [log 1e-2, log 1e2] (P(z = 0) in about [0.002, 0.95] for their stretch and temperature), stated as a
        probability so that it means the same for every gate kind:

        - HardKuma: P(z = 0) = 1 − (1 − t0^α)^β falls with α at fixed β, so α is clamped into the interval
          where P(z = 0) = 1 − min_prob and P(z = 0) = min_prob (closed forms); β keeps its value;
        - HardConcrete: P(z = 0) = σ(τ logit t0 − log α), so log α is clamped into an interval;
        - Sigmoid: deterministic; the logit is clamped to just inside where z reaches 0 and 1, so the clamp's
          gradient stays alive at both ends (``min_prob`` has no meaning there).
        """
        if not 0.0 <= min_prob < 0.5:
            raise ValueError(f"min_prob must be in [0, 0.5), got {min_prob}")
        self.clamp_(bound)
        t0, t1 = -self.low / (self.high - self.low), (1 - self.low) / (self.high - self.low)
        if self.kind == "sigmoid":  # 1e-4 inside, so rounding cannot push z past the clamp
            self.params["logit"].clamp_(math.log(t0 / (1 - t0)) + 1e-4, math.log(t1 / (1 - t1)) - 1e-4)
            return
        if min_prob == 0.0:
            return
        if self.kind == "hardkuma":
            log_alpha = self.params["log_alpha"]
            beta = self.params["log_beta"].double().exp()

            def log_alpha_at(p: float) -> Tensor:  # 1 − (1 − t0^α)^β = p  ⇔  α = log(1 − (1 − p)^{1/β}) / log t0
                return torch.log(log1mexp(math.log1p(-p) / beta) / math.log(t0))

            log_alpha.copy_(log_alpha.double().clamp(log_alpha_at(1 - min_prob), log_alpha_at(min_prob)))
        elif self.kind == "hardconcrete":
            tau = HardConcrete.beta
            centre = tau * math.log(t0 / (1 - t0))  # P(z = 0) = σ(centre − log α)
            logit = lambda p: math.log(p / (1 - p))  # noqa: E731
            self.params["log_alpha"].clamp_(centre - logit(1 - min_prob), centre - logit(min_prob))
