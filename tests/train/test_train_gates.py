import math

import numpy as np
import pytest
import torch
from scipy.special import betainc, betaln

from rolecall.train.gates import GATES, GateParameters, HardConcrete, HardKuma, Sigmoid, get_gate, log1mexp

N = 10**6
GRID = [(a, b) for a in (0.3, 1.0, 2.5) for b in (0.4, 1.0, 4.0)]
EXTREMES = [1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e3]


def _close(mc: float, exact: float, var: float) -> bool:
    """Within five Monte Carlo standard errors (plus rounding)."""
    return abs(mc - exact) <= 5 * math.sqrt(var / N) + 1e-6


@pytest.mark.parametrize("alpha, beta", GRID)
def test_hardkuma_closed_forms_match_monte_carlo(alpha, beta):
    gate = HardKuma(torch.tensor(alpha, dtype=torch.float64), torch.tensor(beta, dtype=torch.float64))
    z = gate.rsample((N,), generator=torch.Generator().manual_seed(1))
    assert z.shape == (N,) and float(z.min()) >= 0 and float(z.max()) <= 1
    p0, p1, ez = float(gate.prob_zero()), float(gate.prob_one()), float(gate.expected_gate())
    assert _close(float((z == 0).double().mean()), p0, p0 * (1 - p0))
    assert _close(float((z == 1).double().mean()), p1, p1 * (1 - p1))
    assert _close(float(z.mean()), ez, float(z.var()))


def test_hardkuma_formulas_by_hand():
    # α = β = 1 is the uniform: P(z=0) = 0.1/1.2, P(z=1) = 0.1/1.2, E[z] = 1/2 by symmetry
    g = HardKuma(torch.ones(3), torch.ones(3))
    assert torch.allclose(g.prob_zero(), torch.full((3,), 1 / 12))
    assert torch.allclose(g.prob_one(), torch.full((3,), 1 / 12))
    assert torch.allclose(g.expected_gate(), torch.full((3,), 0.5))
    assert float(g.expected_l0()) == pytest.approx(3 * 11 / 12)
    # α = 2, β = 1: F(x) = x², so P(z=0) = (1/12)², P(z=1) = 1 − (11/12)²
    g = HardKuma(torch.tensor(2.0), torch.tensor(1.0))
    assert float(g.prob_zero()) == pytest.approx((1 / 12) ** 2)
    assert float(g.prob_one()) == pytest.approx(1 - (11 / 12) ** 2)


def _expected_gate_reference(a, b, low=-0.1, high=1.1):
    """(high − low)/α · B(1/α, β+1) · [I(t1^α) − I(t0^α)] with scipy's regularised incomplete beta."""
    t0, t1 = -low / (high - low), (1 - low) / (high - low)
    coef = np.exp(np.log(high - low) - np.log(a) + betaln(1 / a, b + 1))
    return coef * (betainc(1 / a, b + 1, t1**a) - betainc(1 / a, b + 1, t0**a))


def test_hardkuma_expected_gate_matches_incomplete_beta_and_is_stable_at_extremes():
    A, B = np.meshgrid(EXTREMES, EXTREMES)
    a = torch.tensor(A, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(B, dtype=torch.float64, requires_grad=True)
    g = HardKuma(a, b)
    ez, p0, p1 = g.expected_gate(), g.prob_zero(), g.prob_one()
    for t in (ez.detach(), p0.detach(), p1.detach()):
        assert torch.isfinite(t).all() and float(t.min()) >= 0 and float(t.max()) <= 1
    assert bool((p0 + p1 <= 1 + 1e-12).all())
    assert bool((ez >= p1 - 1e-12).all()) and bool((ez <= 1 - p0 + 1e-12).all())
    ref = _expected_gate_reference(A, B)
    ok = A < 1e3  # scipy's betainc itself loses accuracy for 1/α = 1e-3
    assert np.abs(ez.detach().numpy() - ref)[ok].max() < 1e-9
    (ez.sum() + g.expected_l0() + p1.sum() + g.rsample().sum()).backward()
    assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()
    # float32 parameters work the same and come back as float32
    g32 = HardKuma(a.detach().float(), b.detach().float())
    assert g32.expected_gate().dtype == torch.float32
    assert torch.allclose(g32.expected_gate().double(), ez.detach(), atol=1e-6)


def test_log1mexp_is_accurate_at_both_ends():
    x = torch.tensor([-1e-20, -1e-5, -0.5, -0.7, -5.0, -50.0], dtype=torch.float64)
    want = [math.log(-math.expm1(v)) if v > -0.7 else math.log1p(-math.exp(v)) for v in x.tolist()]
    assert torch.allclose(log1mexp(x), torch.tensor(want, dtype=torch.float64), rtol=1e-12)


@pytest.mark.parametrize("log_alpha", [-2.0, 0.0, 1.5])
def test_hardconcrete_matches_monte_carlo_and_louizos_l0(log_alpha):
    g = HardConcrete(torch.tensor([log_alpha], dtype=torch.float64))
    z = g.rsample((N,), generator=torch.Generator().manual_seed(2))[:, 0]
    p0, p1, ez = float(g.prob_zero()), float(g.prob_one()), float(g.expected_gate())
    assert _close(float((z == 0).double().mean()), p0, p0 * (1 - p0))
    assert _close(float((z == 1).double().mean()), p1, p1 * (1 - p1))
    assert _close(float(z.mean()), ez, float(z.var()))
    # Louizos et al., eq. 12: P(z != 0) = σ(log α − β log(−γ/ζ))
    louizos = 1 / (1 + math.exp(-(log_alpha - 2 / 3 * math.log(0.1 / 1.1))))
    assert float(g.expected_l0()) == pytest.approx(louizos, rel=1e-9)


def test_sigmoid_is_deterministic_clamped_and_l1():
    logit = torch.tensor([-10.0, 0.0, 10.0], requires_grad=True)
    g = Sigmoid(logit)
    z = g.rsample((5,))
    assert torch.equal(z[0], z[4])
    assert z[0].tolist() == pytest.approx([0.0, 0.5, 1.0])
    assert g.prob_zero().tolist() == [1.0, 0.0, 0.0] and g.prob_one().tolist() == [0.0, 0.0, 1.0]
    assert float(g.expected_l0().detach()) == pytest.approx(1.5)
    g.expected_l0().backward()
    assert logit.grad[1] > 0 and logit.grad[0] == 0  # the clamp stops gradients once a gate is exactly 0


def test_registry_parameters_start_where_documented():
    assert set(GATES) == {"hardkuma", "hardconcrete", "sigmoid"}
    with pytest.raises(ValueError, match="unknown gate 'kuma'.*hardkuma"):
        get_gate("kuma")
    p = GateParameters("hardkuma", (3, 2))
    d = p.distribution()
    assert isinstance(d, HardKuma) and torch.equal(d.alpha, torch.ones(3, 2)) and torch.equal(d.beta, torch.ones(3, 2))
    assert float(d.expected_l0().detach()) == pytest.approx(6 * 11 / 12, rel=1e-6)
    d.expected_l0().backward()
    assert all(q.grad is not None for q in p.parameters())
    for kind in GATES:
        gate = GateParameters(kind, (4,)).distribution()
        assert gate.rsample().shape == (4,) and gate.expected_gate().shape == (4,)
        assert gate.expected_l0().dim() == 0


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="low < 0 < 1 < high"):
        HardKuma(torch.ones(1), torch.ones(1), low=0.1)
    with pytest.raises(ValueError, match="alpha > 0"):
        HardKuma(torch.zeros(1), torch.ones(1))
    with pytest.raises(ValueError, match="temperature"):
        HardConcrete(torch.zeros(1), beta=0.0)


@pytest.mark.parametrize("kind", ["hardkuma", "hardconcrete", "sigmoid"])
def test_held_open_gates_leave_e_l0_and_keep_its_gradient(kind):
    """Held gates (sliding layers) add nothing to E[L0]; the others add what they add alone, with a gradient."""
    held = torch.tensor([[True, False], [False, False]])
    free = GateParameters(kind, (2, 2))
    gates = GateParameters(kind, (2, 2), fixed_open=held)
    with torch.no_grad():
        for p, q in zip(free.parameters(), gates.parameters()):
            p.copy_(torch.tensor([[0.3, -0.7], [1.1, 0.2]]))
            q.copy_(p)
    alone = free.distribution()
    per_gate = alone.value() if kind == "sigmoid" else 1 - alone.prob_zero()
    l0 = gates.distribution().expected_l0()
    assert float(l0.detach()) == pytest.approx(float(per_gate.detach().sum() - per_gate[0, 0].detach()), rel=1e-6)
    l0.backward()
    grads = [p.grad for p in gates.parameters()]
    assert all(g is not None and g[0, 0] == 0 and bool((g.flatten()[1:] != 0).all()) for g in grads)
    assert float(gates.distribution().expected_gate()[0, 0].detach()) == 1.0


@pytest.mark.parametrize("kind", ["hardkuma", "hardconcrete"])
def test_constrain_keeps_prob_zero_inside_the_bound_and_moves_nothing_inside(kind):
    """Saturated gates (both ways, and across β for HardKuma) land exactly on P(z = 0) = p or 1 − p; gates
    already inside are left bit for bit."""
    names = GateParameters(kind, (1,)).params.keys()
    raw = {n: torch.tensor([6.9, -6.9, 3.0, -3.0, 0.0, 0.2]) for n in names}
    if kind == "hardkuma":
        raw["log_beta"] = torch.tensor([-4.0, 2.0, 6.9, -6.9, 0.0, 0.3])
    g = GateParameters(kind, (6,))
    for n, v in raw.items():
        g.params[n].data.copy_(v)
    before = g.distribution().prob_zero().double()
    g.constrain_(0.01)
    after = g.distribution().prob_zero().double()
    assert bool(((after >= 0.01 - 1e-6) & (after <= 0.99 + 1e-6)).all()), after
    inside = (before >= 0.01) & (before <= 0.99)
    moved = ~inside
    assert torch.allclose(after[moved], torch.where(before[moved] < 0.01, 0.01, 0.99).double(), atol=1e-6)
    for n in names:
        assert torch.equal(g.params[n].data[inside], raw[n][inside].clamp(-math.log(1e3), math.log(1e3)))


def test_constrain_keeps_the_lagrangian_gradient_of_an_open_gate_alive():
    """An open HardKuma gate at the clamp has ∂P(z ≠ 0)/∂θ ≈ 0, so no λ can close it; bounded at P(z = 0) = p
    the same gradient is of the order of p. A polarised open gate still fits inside the bound."""
    g = GateParameters("hardkuma", (1,))
    g.params["log_alpha"].data.fill_(math.log(1e3))
    g.params["log_beta"].data.fill_(math.log(0.01))
    g.distribution().expected_l0().backward()
    free = g.params["log_alpha"].grad.abs().item()
    g.zero_grad()
    g.constrain_(0.01)
    g.distribution().expected_l0().backward()
    bounded = g.params["log_alpha"].grad.abs().item()
    assert free < 1e-30 and bounded > 1e-3
    assert float(g.distribution().expected_gate().detach()) > 0.95


def test_constrain_sigmoid_keeps_the_clamp_gradient_and_off_means_clamp_only():
    g = GateParameters("sigmoid", (2,))
    g.params["logit"].data.copy_(torch.tensor([50.0, -50.0]))
    g.constrain_(0.01)
    z = g.distribution().rsample()
    assert torch.allclose(z, torch.tensor([1.0, 0.0]), atol=1e-3)
    z.sum().backward()
    assert bool((g.params["logit"].grad.abs() > 1e-3).all())
    k = GateParameters("hardkuma", (1,))
    k.params["log_alpha"].data.fill_(20.0)
    k.constrain_(0.0)
    assert float(k.params["log_alpha"].detach()) == pytest.approx(math.log(1e3))
    with pytest.raises(ValueError, match="min_prob"):
        k.constrain_(0.5)


@pytest.mark.parametrize("kind", ["hardkuma", "hardconcrete"])
@pytest.mark.parametrize("held", [False, True])
def test_l0_goal_is_the_expected_l0_of_exactly_target_decided_gates(kind, held):
    """With 4 gates driven open, the rest shut and held gates left alone, the bound puts E[L0] exactly on
    l0_goal(4, p): target (1 − 2p) + n p over the n learned gates, not 4."""
    p, shape = 0.01, (5, 3)
    fixed = torch.zeros(shape, dtype=torch.bool)
    if held:
        fixed[2] = True  # a sliding layer's three gates
    g = GateParameters(kind, shape, fixed_open=fixed if held else None)
    open_ = torch.zeros(shape, dtype=torch.bool)
    open_.view(-1)[[0, 4, 11, 13]] = True
    g.params["log_alpha"].data.copy_(torch.where(open_, 6.9, -6.9))  # large α: P(z = 0) -> 0 for both kinds
    g.constrain_(p)
    n = 15 - (3 if held else 0)
    goal = g.l0_goal(4, p)
    assert goal == pytest.approx(4 * (1 - 2 * p) + n * p)
    assert float(g.distribution().expected_l0().detach()) == pytest.approx(goal, abs=1e-6)
    assert GateParameters("sigmoid", shape).l0_goal(4, p) == 4.0
    assert g.l0_goal(4, 0.0) == 4.0
