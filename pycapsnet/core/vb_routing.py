"""Variational Bayes routing (Ribeiro, Leontidis & Kollias, AAAI 2020), diagonal covariance, and its
exact backward through every iteration.

The parents are a mixture of Gaussians over the children's votes, fitted by variational Bayes: a
Dirichlet over the mixing weights π, and per parent j a Normal-Wishart over its mean and diagonal
precision Λ_j.  Priors (fixed): α0, κ0, ν0 (> D - 1), Ψ0 = ψ0 I, m0 = 0.  Shapes: votes û_ij (I, N, J, D);
child activations a_i (N, I); responsibilities R (N, J, I); per parent (N, J) or (N, J, D).

M-step, from R (R^0 = 1/J):
    R̃_ij = R_ij a_i,   N_j = Σ_i R̃_ij,   α_j = α0 + N_j,  κ_j = κ0 + N_j,  ν_j = ν0 + N_j
    μ̄_j  = Σ_i R̃_ij û_ij / N_j,   m_j = N_j μ̄_j / κ_j
    P_jd = (Ψ_j⁻¹)_dd = 1/ψ0 + Σ_i R̃_ij (û_ijd - μ̄_jd)² + (κ0 N_j / κ_j) μ̄_jd²
E-step (every iteration but the last), in log space, normalised over the parents j:
    E[ln π_j]  = ψ(α_j) - ψ(Σ_k α_k)
    E[ln|Λ_j|] = Σ_{d=1..D} ψ((ν_j + 1 - d)/2) + D ln 2 - Σ_d ln P_jd
    E[Q_ij]    = D/κ_j + ν_j Σ_d (û_ijd - m_jd)² / P_jd
    ln ρ_ij    = E[ln π_j] + ½ E[ln|Λ_j|] - ½ E[Q_ij]  (- D/2 ln 2π, the same for every j)
    R_ij       = softmax_j(ln ρ_ij)
Activation, after the last M-step, from the entropy of the posterior, H_j = D/2 ln(2πe) - ½ E[ln|Λ_j|]:
    a_j = sigmoid(λ (β_a,j - (β_u,j + π̃_j H_j))),   π̃_j = exp E[ln π_j]
and the parent emits v_j = a_j m_j / |m_j| (its posterior mean's direction, its activation as length;
a child's activation is its length |u_i|, as in self_routing.py).

Departures of the public code (fabio-deep/Variational-Capsule-Routing), where this follows the
paper: docs/backprop.md lists them.  ψ is the digamma function, ψ' (its derivative, the trigamma)
appears in the backward; both are backend operations (B.digamma, B.trigamma).

Backward: the adjoint of each step, walked from the activation and the output pose back through
the last M-step, then each E-step and M-step in turn (mode "full"); mode "final" holds the last
R constant and stops after the last M-step.  Each step's adjoint is a function below.
"""
from __future__ import annotations

import math

import numpy as np

from .routing import softmax, softmax_backward
from .routing_contract import Routing
from .self_routing import child_activations

# The priors and λ arrive as ``prior``: VB.options below, checked by VB.check_options.


def _sig(xp, z):
    """The logistic sigmoid from e^-|z|, which never overflows (a large λ saturates it either way)."""
    e = xp.exp(-xp.abs(z))
    return xp.where(z >= 0, 1 / (1 + e), e / (1 + e))


def m_step(B, u_hat, a_in, R, prior):
    """The posterior's parameters from responsibilities R: a dict of the step's arrays."""
    xp = B.xp
    Rt = R * a_in[:, None, :]                                   # R̃ (N, J, I)
    Nj = xp.sum(Rt, axis=2)                                     # (N, J)
    mean = B.weighted_sum(Rt, u_hat) / Nj[..., None]            # μ̄ (N, J, D)
    kappa = prior["kappa0"] + Nj
    diff = u_hat - mean[None]                                   # (I, N, J, D)
    S = B.weighted_sum(Rt, diff * diff)
    P = 1 / prior["psi0"] + S + (prior["kappa0"] * Nj / kappa)[..., None] * mean * mean
    return {"R": R, "Rt": Rt, "N": Nj, "mean": mean, "m": (Nj / kappa)[..., None] * mean, "kappa": kappa,
            "nu": prior["nu0"] + Nj, "alpha": prior["alpha0"] + Nj, "diff": diff, "P": P}


def expectations(B, M, D):
    """(E[ln π_j], E[ln|Λ_j|]) (N, J) of an M-step's posterior."""
    xp = B.xp
    eln_pi = B.digamma(M["alpha"]) - B.digamma(xp.sum(M["alpha"], axis=1, keepdims=True))
    half = (M["nu"][..., None] + 1 - B.arange(1, D + 1)) / 2     # (N, J, D)
    eln_lam = xp.sum(B.digamma(half), axis=-1) + D * math.log(2) - xp.sum(xp.log(M["P"]), axis=-1)
    return eln_pi, eln_lam


def e_step(B, u_hat, M, D):
    """R_ij = softmax_j(ln ρ_ij) and what the backward needs."""
    xp = B.xp
    eln_pi, eln_lam = expectations(B, M, D)
    dev = u_hat - M["m"][None]                                  # û - m (I, N, J, D)
    Z = B.agreement(dev * dev, 1 / M["P"])                      # Σ_d (û - m)² / P (N, J, I)
    ln_rho = (eln_pi + eln_lam / 2 - D / (2 * M["kappa"]))[..., None] - M["nu"][..., None] * Z / 2
    return softmax(xp, ln_rho, axis=1), (dev, Z)


def vb_forward(B, u_hat, a_in, beta_a, beta_u, iters, prior, fixed=None):
    """û (I, N, J, D), a_in (N, I) -> (v (N, J, D), trace: the M-steps, E-steps and the output's)."""
    xp = B.xp
    n_in, n, J, D = u_hat.shape
    R = B.zeros((n, J, n_in)) + 1.0 / J
    Ms, Es = [], []
    for t in range(iters):
        if t == iters - 1 and fixed is not None:
            R = fixed
        M = m_step(B, u_hat, a_in, R, prior)
        Ms.append(M)
        if t < iters - 1:
            R, saved = e_step(B, u_hat, M, D)
            Es.append(saved)
    eln_pi, eln_lam = expectations(B, M, D)
    H = D / 2 * math.log(2 * math.pi * math.e) - eln_lam / 2
    pi = xp.exp(eln_pi)
    a = _sig(xp, prior["vb_lambda"] * (beta_a - (beta_u + pi * H)))
    m = M["m"]
    norm = xp.sqrt(xp.sum(m * m, axis=-1))
    direction = m / norm[..., None]
    return direction * a[..., None], (Ms, Es, (H, pi, a, direction, norm))


def _expectations_backward(B, M, d_eln_pi, d_eln_lam, D, grads):
    """Adds into ``grads`` (dα, dν, dP) the adjoint of ``expectations``."""
    xp = B.xp
    alpha = M["alpha"]
    grads["alpha"] = grads["alpha"] + d_eln_pi * B.trigamma(alpha) \
        - xp.sum(d_eln_pi, axis=1, keepdims=True) * B.trigamma(xp.sum(alpha, axis=1, keepdims=True))
    half = (M["nu"][..., None] + 1 - B.arange(1, D + 1)) / 2
    grads["nu"] = grads["nu"] + d_eln_lam * xp.sum(B.trigamma(half), axis=-1) / 2
    grads["P"] = grads["P"] - d_eln_lam[..., None] / M["P"]


def _e_step_backward(B, u_hat, M, saved, R_next, dR, D, grads, du_hat):
    """Adds the adjoint of ``e_step`` into ``grads`` (of the M-step it read) and its dû into ``du_hat``."""
    xp = B.xp
    dev, Z = saved
    dl = softmax_backward(xp, R_next, dR, axis=1)              # d ln ρ (N, J, I)
    dsum = xp.sum(dl, axis=2)                                  # (N, J)
    _expectations_backward(B, M, dsum, dsum / 2, D, grads)
    grads["kappa"] = grads["kappa"] + D / 2 * dsum / (M["kappa"] * M["kappa"])
    grads["nu"] = grads["nu"] - xp.sum(dl * Z, axis=2) / 2
    G = -dl * M["nu"][..., None] / 2                           # dL/dZ_ij (N, J, I)
    inv_P = 1 / M["P"]
    # Z = Σ_d dev² / P:  d dev = 2 G dev / P (per i, j, d),  dP = -Σ_i G dev² / P²
    g_dev = dev * (2 * inv_P)[None]
    g_dev *= xp.permute_dims(G, (2, 0, 1))[..., None]
    du_hat += g_dev
    grads["m"] = grads["m"] - xp.sum(g_dev, axis=0)
    grads["P"] = grads["P"] - B.weighted_sum(G, dev * dev) * inv_P * inv_P


def _m_step_backward(B, u_hat, a_in, M, grads, prior, du_hat):
    """The adjoint of ``m_step`` from ``grads`` (dm, dP, dN, dκ, dν, dα): (dR, da_in), its dû added
    into ``du_hat``.  With
    T = Σ_i R̃ û:  μ̄ = T/N,  m = T/κ,  κ, ν, α = prior + N,  P's last term c μ̄² with c = κ0 N/κ."""
    xp = B.xp
    Nj, kappa, mean, Rt, diff = M["N"], M["kappa"], M["mean"], M["Rt"], M["diff"]
    k0 = prior["kappa0"]
    dm, dP = grads["m"], grads["P"]
    dT = dm / kappa[..., None]
    dkappa = grads["kappa"] - xp.sum(dm * M["m"], axis=-1) / kappa
    dmean = 2 * (k0 * Nj / kappa)[..., None] * dP * mean
    dN = grads["N"] + grads["alpha"] + grads["nu"] + dkappa \
        + xp.sum(dP * mean * mean, axis=-1) * (k0 * k0) / (kappa * kappa)       # dc/dN = κ0²/κ²
    # S = Σ_i R̃ (û - μ̄)²; its dμ̄ is 0, since Σ_i R̃ (û - μ̄) = 0
    dRt = B.agreement(diff * diff, dP)
    dT = dT + dmean / Nj[..., None]                                           # μ̄ = T/N
    dN = dN - xp.sum(dmean * mean, axis=-1) / Nj
    dRt = dRt + B.agreement(u_hat, dT) + dN[..., None]                        # T = Σ R̃ û,  N = Σ R̃
    # dû_ij = R̃_ij (2 dP_j (û_ij - μ̄_j) + dT_j): from S, then from T
    term = diff * (2 * dP)[None]
    term += dT[None]
    term *= xp.permute_dims(Rt, (2, 0, 1))[..., None]
    du_hat += term
    return dRt * a_in[:, None, :], xp.sum(dRt * M["R"], axis=1)


def _zero_grads(B, M):
    z = lambda x: B.zeros(tuple(x.shape))
    return {"m": z(M["m"]), "P": z(M["P"]), "N": z(M["N"]), "alpha": z(M["N"]), "nu": z(M["N"]), "kappa": z(M["N"])}


def vb_backward(B, u_hat, a_in, trace, dv, beta_a, beta_u, prior, mode="full"):
    """From dL/dv: (dû, {"beta_a": dβ_a (J,), "beta_u": dβ_u (J,)}, da_in (N, I))."""
    xp = B.xp
    Ms, Es, (H, pi, a, direction, norm) = trace
    D = u_hat.shape[-1]
    lam = prior["vb_lambda"]
    # v = a m / |m|
    da = xp.sum(dv * direction, axis=-1)
    grads = _zero_grads(B, Ms[-1])
    grads["m"] = (dv - direction * da[..., None]) * (a / norm)[..., None]
    # a = σ(λ (β_a - β_u - π̃ H))
    dz = da * a * (1 - a) * lam
    dpi, dH = -dz * H, -dz * pi
    _expectations_backward(B, Ms[-1], dpi * pi, -dH / 2, D, grads)
    du_hat, da_in = B.zeros(tuple(u_hat.shape)), 0
    for t in reversed(range(len(Ms))):
        dR, da_t = _m_step_backward(B, u_hat, a_in, Ms[t], grads, prior, du_hat)
        da_in = da_in + da_t
        if t == 0 or mode == "final":
            break
        grads = _zero_grads(B, Ms[t - 1])
        _e_step_backward(B, u_hat, Ms[t - 1], Es[t - 1], Ms[t]["R"], dR, D, grads, du_hat)
    return du_hat, {"beta_a": xp.sum(dz, axis=0), "beta_u": -xp.sum(dz, axis=0)}, da_in


def vb_coupling(trace) -> list:
    """The responsibilities R (N, J, I) each M-step used."""
    return [M["R"] for M in trace[0]]


class VB(Routing):
    """Variational Bayes routing.  Its options are the priors and the activation's inverse temperature
    λ (vb_lambda): at 1, the margin loss's push on the nine absent classes saturates every class's
    sigmoid within the first steps and the paper's network stays at chance on the embedded digits;
    at 0.1 it trains (docs/performance.md, "The routing family").  Its network's transforms start at
    init.routed_std: at 0.01 the votes are so small that Ψ0 swamps their spread."""
    name, iterated, modes, reads_children, symbol = "vb", True, ("full", "final"), True, "R_ij"
    options = {"alpha0": 1.0, "kappa0": 1.0, "psi0": 1.0, "nu0": None, "vb_lambda": 0.1}
    transform_std = None
    # Where the priors keep every step's numbers finite in float32: 1/ψ0 enters every precision, and
    # beyond these bounds the Wishart's scale or the Dirichlet's counts leave float32's range.
    BOUNDS = {"alpha0": (1e-4, 1e4), "kappa0": (1e-4, 1e4), "psi0": (1e-4, 1e4), "vb_lambda": (1e-4, 1e4)}
    NU0_ABOVE_D = 1e4

    def check_options(self, options, D):
        for k, (lo, hi) in self.BOUNDS.items():
            if not lo <= options[k] <= hi:
                raise ValueError(f"{k} must be a finite number in [{lo:g}, {hi:g}] (beyond, VB routing's numbers "
                                 f"leave float32's range), got {options[k]:g}")
        nu0 = float(D + 1) if options["nu0"] is None else float(options["nu0"])
        if not D - 1 < nu0 <= D - 1 + self.NU0_ABOVE_D:
            raise ValueError(f"nu0 must be above dim - 1 = {D - 1} (the Wishart's degrees of freedom) and at most "
                             f"{D - 1 + self.NU0_ABOVE_D:g}, got {nu0:g}")
        return {**options, "nu0": nu0}

    def params(self, lead, J, D, K) -> dict:
        return {"beta_a": np.zeros(J), "beta_u": np.zeros(J)}

    def forward(self, B, u_hat, p, u, fixed=None):
        a_in = child_activations(B.xp, u)
        return vb_forward(B, u_hat, a_in, p["beta_a"], p["beta_u"], self.iters, self.options, fixed)

    def backward(self, B, u_hat, u, trace, dv, p):
        xp = B.xp
        du_hat, grads, da = vb_backward(B, u_hat, child_activations(xp, u), trace, dv, p["beta_a"], p["beta_u"],
                                        self.options, self.mode)
        size = xp.sqrt(xp.sum(u * u, axis=-1, keepdims=True))   # a_i = |u_i|
        du = xp.where(size > 0, u * (xp.matrix_transpose(da)[..., None] / xp.where(size > 0, size, 1)), 0)
        return du_hat, grads, du

    def coupling(self, trace) -> list:
        return vb_coupling(trace)
