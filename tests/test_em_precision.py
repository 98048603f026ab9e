"""EM routing's backward where rounding bites: a parent fed by one dominant child, its variance at
the 1e-6 floor (issue 66).  There the votes' deviations d = V - μ are ~1e-8 while dσ² is ~1e3, so a
backward that mixes a closed form with the rounded d is off by 2 |dσ²| · (μ's rounding) -- 1e-8 of
the tensor.  The oracles: autograd in float64 (both modes) and, for "final" (the last M-step with
its assignments held), central differences of that function computed in long double.  The tolerance
is 1e-10 of each tensor's largest entry (assert_close)."""
from pycapsnet import backends  # noqa: I001
import numpy as np
import pytest

from pycapsnet.core.em_routing import em_backward, em_forward, inverse_temperatures
from tests.conftest import CPU_BACKENDS, assert_close

torch = pytest.importorskip("torch", reason="the autograd oracle needs PyTorch")

RTOL = 1e-10
EPS = 1e-6  # the M-step's ε of r + ε and the ε added to σ², as the layers use them


def saturated_case():
    """A class layer (P = 1) of 8 children and 3 parents: child 0 on (a = 1), the rest nearly off
    (a = 1e-9), so every parent receives child 0 alone (w ≈ 1 - 3e-6) and σ² sits at its floor.
    Votes are offset by 3 so that μ's rounding is not small.  The gradient reaches the routing
    through the activations only (dμ = 0), as it does for a class that is not the label."""
    rng = np.random.default_rng(7)
    V = 3 + rng.standard_normal((2, 1, 8, 3, 16))
    a_in = np.full((2, 1, 8), 1e-9)
    a_in[:, :, 0] = 1
    beta_u, beta_a = np.array([0.1, -0.2, 0.05]), np.array([-100.0, -110.0, -120.0])
    lambdas = inverse_temperatures(0.01, 3)
    dmu, da = np.zeros((2, 1, 3, 16)), rng.standard_normal((2, 1, 3))
    return V, a_in, beta_u, beta_a, lambdas, dmu, da


def library(spec, mode, case):
    """The hand-written backward: (dV, da_in, dβ_u, dβ_a) as NumPy arrays, and the trace."""
    B = backends.get(spec, dtype="float64")
    V, a_in, beta_u, beta_a, lambdas, dmu, da = (x if isinstance(x, list) else B.asarray(x) for x in case)
    _, _, trace = em_forward(B, V, a_in, beta_u, beta_a, lambdas, EPS, var_eps=EPS)
    grads = em_backward(B, V, a_in, beta_u, lambdas, trace, dmu, da, EPS, mode=mode)
    return [B.to_numpy(g) for g in grads], trace


def m_step(xp, V, a_in, R, beta_u, beta_a, lam):
    """One M-step written plainly (for autograd on torch tensors, or long double on NumPy)."""
    Rp = R * a_in[..., None]
    r = Rp.sum(2)
    w = Rp / (r[:, :, None] + EPS)
    mu = (w[..., None] * V).sum(2)
    var = (w[..., None] * (V - mu[:, :, None]) ** 2).sum(2) + EPS
    z = lam * (beta_a - r * (V.shape[-1] * beta_u + 0.5 * xp.log(var).sum(-1)))
    return mu, var, z


def autograd(case, fixed_R=None):
    """Gradients of Σ dμ·μ + Σ da·a by torch autograd, float64, through every iteration (or the last
    M-step alone with R = fixed_R)."""
    V, a_in, beta_u, beta_a, lambdas, dmu, da = case
    t = [torch.tensor(x, requires_grad=True) for x in (V, a_in, beta_u, beta_a)]
    Vt, at, bu, ba = t
    R = torch.full(tuple(a_in.shape) + (V.shape[3],), 1 / V.shape[3], dtype=torch.float64)
    for i, lam in enumerate(lambdas):
        if i == len(lambdas) - 1 and fixed_R is not None:
            R = torch.tensor(np.asarray(fixed_R))  # NumPy or a CPU tensor
        mu, var, z = m_step(torch, Vt, at, R, bu, ba, lam)
        if i < len(lambdas) - 1:
            d = Vt - mu[:, :, None]
            ln_p = -(d ** 2 / (2 * var[:, :, None]) + 0.5 * torch.log(2 * np.pi * var[:, :, None])).sum(-1)
            R = torch.softmax(torch.nn.functional.logsigmoid(z)[:, :, None] + ln_p, dim=-1)
    ((mu * torch.tensor(dmu)).sum() + (torch.sigmoid(z) * torch.tensor(da)).sum()).backward()
    return [x.grad.numpy() for x in t]


def long_double_differences(case, R, h=1e-3):
    """Central differences of the last M-step with its R held, in long double (rounding ~1e-19), each
    entry moved by h of its size (a_in = 1e-9 must stay positive)."""
    V, a_in, beta_u, beta_a, lambdas, dmu, da = (np.asarray(x, np.longdouble) for x in case)
    R = np.asarray(R, np.longdouble)

    def f(V, a_in, beta_u, beta_a):
        mu, _, z = m_step(np, V, a_in, R, beta_u, beta_a, lambdas[-1])
        return (mu * dmu).sum() + (da / (1 + np.exp(-z))).sum()

    inputs, grads = [V, a_in, beta_u, beta_a], []
    for k, x in enumerate(inputs):
        g = np.zeros(x.shape)
        for idx in np.ndindex(x.shape):
            step = h * float(abs(x[idx])) or h

            def at(m):  # f with this entry moved by m steps
                moved = [y.copy() for y in inputs]
                moved[k][idx] += m * step
                return f(*moved)

            # the five-point stencil: truncation O(step^4)
            g[idx] = float((8 * (at(1) - at(-1)) - (at(2) - at(-2))) / (12 * step))
        grads.append(g)
    return grads


NAMES = ("dV", "da_in", "dbeta_u", "dbeta_a")


def test_the_case_is_saturated():
    """What the case claims: one child carries ≥ 1 - 1e-5 of every parent (ε/r_j of it goes to r_j + ε) and σ² is at the floor."""
    case = saturated_case()
    _, trace = library("numpy", "full", case)
    R, _, var, r, _, _ = trace[-1]
    w = R * case[1][..., None] / (r[:, :, None] + EPS)
    assert w[:, :, 0].min() > 1 - 1e-5 and var.max() < 1.1 * EPS


@pytest.mark.parametrize("spec", CPU_BACKENDS)
@pytest.mark.parametrize("mode", ["full", "final"])
def test_a_single_child_parent_matches_autograd(spec, mode):
    case = saturated_case()
    grads, trace = library(spec, mode, case)
    ref = autograd(case, fixed_R=trace[-1][0] if mode == "final" else None)
    for name, mine, theirs in zip(NAMES, grads, ref):
        assert_close(mine, theirs, RTOL, what=f"{name} ({mode})")


@pytest.mark.parametrize("spec", CPU_BACKENDS)
def test_a_single_child_parent_matches_long_double_differences(spec):
    case = saturated_case()
    grads, trace = library(spec, "final", case)
    R = backends.get(spec, dtype="float64").to_numpy(trace[-1][0])
    for name, mine, theirs in zip(NAMES, grads, long_double_differences(case, R)):
        assert_close(mine, theirs, RTOL, what=f"{name} (final)")



@pytest.mark.parametrize("spec", CPU_BACKENDS)
def test_a_saturated_primary_activation_keeps_its_slope(spec):
    """a = sigmoid(logit) rounds to 1 past logit ~37; its slope e^-logit must not become 1 - a = 0."""
    from pycapsnet.core.matrix_capsules import PrimaryMatrixCaps

    B = backends.get(spec, dtype="float64")
    layer = PrimaryMatrixCaps(B, 3, types=2, rng=np.random.default_rng(0))
    layer.params["b"][...] = B.asarray(np.r_[np.zeros(32), 40.0, -1.0])  # type 0 saturated, type 1 not
    rng = np.random.default_rng(1)
    h, da = rng.random((2, 2, 2, 3)), rng.standard_normal((2, 2, 2, 2))
    da[..., 1] = 0  # the gradient reaches the saturated type only
    _, a = layer.forward(B.asarray(h))
    assert B.to_numpy(a)[..., 0].min() == 1.0
    dh = B.to_numpy(layer.backward((B.zeros((2, 2, 2, 2, 16)), B.asarray(da))))

    W, b = (torch.tensor(B.to_numpy(layer.params[k])) for k in ("W", "b"))
    ht = torch.tensor(h, requires_grad=True)
    # exp(logsigmoid(z)): autograd's own sigmoid backward is y (1 - y), which is 0 here too
    (torch.exp(torch.nn.functional.logsigmoid((ht @ W + b)[..., 32:])) * torch.tensor(da)).sum().backward()
    assert 0 < np.abs(dh).min() and np.abs(dh).max() < 1e-15  # e^-40: tiny, and not zero
    assert_close(dh, ht.grad.numpy(), RTOL, what="dh")


@pytest.mark.parametrize("spec", CPU_BACKENDS)
def test_sum_children_pair_is_two_sums(spec):
    """The one-pass pair of weighted sums (NumPy: one batched product) gives each sum."""
    B = backends.get(spec, dtype="float64")
    rng = np.random.default_rng(0)
    w, v, x = (B.asarray(rng.standard_normal(s)) for s in ((2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 5, 4, 16)))
    for wx in (None, w[..., None] * x):
        a, b = B.sum_children_pair(w, v, x, wx=wx)
        np.testing.assert_allclose(B.to_numpy(a), B.to_numpy(B.sum_children(w, x)), rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(B.to_numpy(b), B.to_numpy(B.sum_children(v, x)), rtol=1e-13, atol=1e-13)
