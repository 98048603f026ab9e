"""EM routing between matrix capsules (Hinton, Sabour & Frosst 2018, Procedure 1) and its exact backward.

Shapes (N samples, P parent positions, I child slots per parent position, C parent types, H = 16
entries of a 4x4 pose).  A convolutional layer sees each child through every window that holds it:
slot i of position p is one (kernel offset, child type) pair, and the same child sits in several
(p, i) slots.  A class layer has P = 1 and each child in one slot.
    V      V_ij   (N, P, I, C, H)  votes of the children for their parents, V_ij = M_i W_ij
    a_in   a_i    (N, P, I)        child activations, as each slot sees them
    R      R_ij   (N, P, I, C)     assignment of child i to parent j
    mu     μ_j    (N, P, C, H)     parent poses (the output), var σ²_j likewise
    a      a_j    (N, P, C)        parent activations (the output)
    beta_u, beta_a (C,)            learned, one per parent type

Every child's assignments sum to 1 over *all* the parents that receive it -- the C types at every
position whose window holds it -- so parents at different positions compete for a child as parents
of different types do.  ``group`` says which slots are the same child: group.sum(x) adds x over the
slots of each child and hands every slot its child's total (identity for a class layer);
group.max(x) likewise with the maximum; group.copies() is the number of slots of each slot's child.
R^0 is uniform: 1 / (C x the number of slots of the child).

Forward, for t = 0 .. T-1, at inverse temperature λ_t:
  M-step   R'_ij = R_ij a_i,   r_j = sum_i R'_ij,   w_ij = R'_ij / (r_j + ε)
           μ_jh = sum_i w_ij V_ijh,   σ²_jh = sum_i w_ij (V_ijh - μ_jh)² + ε
           cost_j = sum_h (β_u + ½ ln σ²_jh) r_j,   z_j = λ_t (β_a - cost_j),   a_j = sigmoid(z_j)
  E-step   (t < T-1 only: the last M-step's R is never used)
           L_ij = ln a_j + ln p_ij,   ln p_ij = -sum_h ((V_ijh - μ_jh)² / (2σ²_jh) + ½ ln(2π σ²_jh))
           R_ij = exp(L_ij) / sum_{j' receiving i} exp(L_ij')        (in log space, ln a_j = log-sigmoid(z_j))
The paper divides by r_j; dividing by r_j + ε keeps μ and σ² finite when every child is off (r_j = 0).

Backward, mode "full".  Walk t from T-1 down to 0 carrying dR = dL/dR^{t+1} (none at T-1, where
dμ and da are the incoming gradients), with d_ijh = V_ijh - μ_jh and q_ijh = d_ijh / σ²_jh:
  E-step t (t < T-1), R = R^{t+1}:
    dL_ij   = R_ij (dR_ij - group.sum(sum_j' R_ij' dR_ij'))        (softmax backward over the group)
    dz_j    = sigmoid(-z_j) sum_i dL_ij                         (d ln sigmoid(z) / dz = 1 - a, taken from z:
                                                                 exact where a_j rounds to 1)
    dμ_jh   = sum_i dL_ij q_ijh,   dσ²_jh = ½ sum_i dL_ij (q²_ijh - 1/σ²_jh),   dV_ijh -= dL_ij q_ijh
  (at T-1 instead: dz_j = da_j a_j sigmoid(-z_j), dσ² = 0)
  M-step t:
    dβ_a += λ_t sum dz_j,   dcost_j = -λ_t dz_j,   dβ_u += H sum dcost_j r_j
    dr_j  = dcost_j sum_h (β_u + ½ ln σ²_jh),   dσ²_jh += dcost_j r_j / (2σ²_jh)
    dμ_jh -= 2 dσ²_jh sum_i w_ij d_ijh    (σ² depends on μ too; summed, not in closed form)
    dw_ij = sum_h (dσ²_jh d²_ijh + dμ_jh V_ijh),   dV_ijh += w_ij (2 dσ²_jh d_ijh + dμ_jh)
    dR'_ij = dw_ij / (r_j + ε) + dr_j - sum_i' dw_i'j w_i'j / (r_j + ε)
    da_i += sum_j dR'_ij R_ij,   dR = dR'_ij a_i  (carried into E-step t-1; R^0 is a constant)

Backward, mode "final": the last M-step alone, its R^{T-1} held constant (as if the routing ran
under stop-gradient and only the last M-step saw the gradient): the exact gradient of that function
(``fixed_assignments`` makes it, for the tests).
"""
from __future__ import annotations

import math

from .layers import sigmoid

MODES = ("full", "final")


def log_sigmoid(xp, z):
    """ln sigmoid(z) = -ln(1 + e^-z) = min(z, 0) - ln(1 + e^-|z|): finite where sigmoid(z) rounds to 0.

    min(z, 0) is written (z - |z|) / 2, which is exact: xp.minimum(z, 0) makes a host tensor of the 0
    on torch, which a CUDA graph cannot record."""
    a = xp.abs(z)
    return (z - a) / 2 - xp.log1p(xp.exp(-a))


class Identity:
    """The group of a class layer: every child has one slot."""

    @staticmethod
    def sum(x):
        return x

    @staticmethod
    def max(x):
        return x

    @staticmethod
    def part(sl, n):
        return Identity

    @staticmethod
    def copies():
        return 1


def inverse_temperatures(lam: float, iters: int):
    """λ_t = λ (t + 1) / T: the activations sharpen linearly to λ at the last M-step.  Early
    iterations keep a_j soft so that parents that start badly placed still compete for children
    (deterministic annealing); the paper increases the inverse temperature at each iteration
    without giving a schedule.  The networks' default λ is 1e-3: the cost sums ½ ln σ² over 16
    entries and over every child a parent receives, so a larger λ saturates the activations, and
    ln a_j then feeds back into the E-step (docs/performance.md; the runs behind it are in its git history)."""
    return [lam * (t + 1) / iters for t in range(iters)]


def m_step(B, V, a_in, R, beta_u, beta_a, lam, eps, var_eps):
    """Returns (mu, var, r, z, a, d2): parent poses, variances, assigned mass, activation logits,
    activations, and the votes' squared deviations d²_ijh = (V_ijh - μ_jh)² (which the E-step reuses)."""
    xp = B.xp
    Rp = R * a_in[..., None]                           # R'_ij (N, P, I, C)
    r = xp.sum(Rp, axis=2)                             # r_j (N, P, C)
    w = Rp / (r[:, :, None] + eps)                     # w_ij
    mu = B.sum_children(w, V)                          # μ_jh = sum_i w_ij V_ijh  (N, P, C, H)
    d2 = V - mu[:, :, None]
    d2 *= d2                                           # d²_ijh (N, P, I, C, H)
    var = B.sum_children(w, d2) + var_eps            # σ²_jh = sum_i w_ij d²_ijh + ε
    cost = r * (V.shape[-1] * beta_u + 0.5 * xp.sum(xp.log(var), axis=-1))
    z = lam * (beta_a - cost)
    return mu, var, r, z, sigmoid(xp, z), d2


def e_step(B, d2, var, z, group):
    """R_ij = a_j p_ij normalised over every parent that receives child i, in log space."""
    xp = B.xp
    ln_norm = -0.5 * xp.sum(xp.log((2 * math.pi) * var), axis=-1)         # (N, P, C): the same for every i
    ln_p = -0.5 * B.sum_entries(d2, 1 / var) + ln_norm[:, :, None]        # (N, P, I, C)
    L = log_sigmoid(xp, z)[:, :, None] + ln_p
    top = group.max(xp.max(L, axis=-1))                # the child's largest L: exp(L - top) <= 1, one term = 1
    e = xp.exp(L - top[..., None])
    return e / group.sum(xp.sum(e, axis=-1))[..., None]


def em_forward(B, V, a_in, beta_u, beta_a, lambdas, eps=1e-6, group=Identity, fixed_assignments=None,
               var_eps=1e-6):
    """Returns (mu, a, trace); trace[t] = (R^t, mu^t, var^t, r^t, z^t, a^t) for the backward and for
    inspection.  ``fixed_assignments``: use this R in the last M-step (the function "final" differentiates)."""
    n, p, i, c, _ = V.shape
    R = B.zeros((n, p, i, c)) + 1 / (c * group.copies())
    trace = []
    for t, lam in enumerate(lambdas):
        if t == len(lambdas) - 1 and fixed_assignments is not None:
            R = fixed_assignments
        mu, var, r, z, a, d2 = m_step(B, V, a_in, R, beta_u, beta_a, lam, eps, var_eps)
        trace.append((R, mu, var, r, z, a))
        if t < len(lambdas) - 1:
            R = e_step(B, d2, var, z, group)
    return mu, a, trace


def _weights(R, a_in, r, eps):
    """w_ij = R_ij a_i / (r_j + ε), the M-step's normalised weights."""
    return R * a_in[..., None] / (r[:, :, None] + eps)


def em_backward(B, V, a_in, beta_u, lambdas, trace, dmu, da, eps=1e-6, group=Identity, mode="full", out=None):
    """From dL/dμ (N, P, C, H) and dL/da (N, P, C) of the last iteration to
    (dV (N, P, I, C, H), da_in (N, P, I), dβ_u (C,), dβ_a (C,)); dV is written into ``out`` if given."""
    xp = B.xp
    if mode not in MODES:
        raise ValueError(f"unknown routing gradient mode {mode!r}: use one of {MODES}")
    H = V.shape[-1]
    if out is None:
        dV = B.zeros(tuple(V.shape))
    else:
        dV = out
        dV[...] = 0
    da_in = B.zeros(tuple(a_in.shape))
    dbeta_u = B.zeros(tuple(beta_u.shape))
    dbeta_a = B.zeros(tuple(beta_u.shape))
    last = len(trace) - 1
    steps = [last] if mode == "final" else range(last, -1, -1)
    dR = None  # dL/dR^{t+1}
    for t in steps:
        R, mu, var, r, z, a = trace[t]
        d = V - mu[:, :, None]                                 # (N, P, I, C, H)
        w = _weights(R, a_in, r, eps)                          # (N, P, I, C)
        if t == last:
            # a (1 - a) = sigmoid(z) sigmoid(-z): from z, so that a saturated a_j (1 - a_j rounds to 0
            # once z > ~37 in float64) keeps its exact, tiny slope e^-z
            dz, dmu_t, dvar = da * a * sigmoid(xp, -z), dmu, 0
        else:  # E-step t made R^{t+1} from μ^t, σ²^t, z^t
            R1 = trace[t + 1][0]
            dL = R1 * (dR - group.sum(xp.sum(R1 * dR, axis=-1))[..., None])
            dz = sigmoid(xp, -z) * xp.sum(dL, axis=2)          # d ln sigmoid(z) / dz = sigmoid(-z) = 1 - a
            q = d / var[:, :, None]
            dLq = q * dL[..., None]                            # dL_ij q_ijh
            # Σ_i dL_ij q_ijh, and Σ_i w_ij q_ijh for the variance term below (a backend may take
            # both in one pass over q)
            dmu_t, wq = B.sum_children_pair(dL, w, q, wx=dLq)
            dV -= dLq
            dLq *= q
            dvar = 0.5 * (xp.sum(dLq, axis=2) - xp.sum(dL, axis=2)[..., None] / var)
            del q, dLq
        lam = lambdas[t]
        dbeta_a += lam * xp.sum(dz, axis=(0, 1))
        dcost = -lam * dz                                      # (N, P, C)
        dbeta_u += H * xp.sum(dcost * r, axis=(0, 1))
        dr = dcost * (H * beta_u + 0.5 * xp.sum(xp.log(var), axis=-1))
        dvar = dvar + (dcost * r)[..., None] / (2 * var)
        # σ² depends on μ too: dμ -= 2 dσ² sum_i w_ij d_ijh.  In exact arithmetic that sum is
        # μ_jh ε / (r_j + ε), but it must be summed from the same rounded d that moments_backward
        # uses: where one child carries a parent (d ~ 1e-8, σ² at its floor, dσ² ~ 1e3) the closed
        # form leaves 2 dσ² times μ's rounding uncancelled in dV (docs/backprop.md).  After an
        # E-step it is σ² sum_i w q, summed above with the E-step's own sum over q.
        dmu_t = dmu_t - 2 * dvar * (B.sum_children(w, d) if t == last else var * wq)
        # with g = dσ² d + dμ:  dV += w (2 dσ² d + dμ) = w (2g - dμ),  and, as V = d + μ,
        # dw_ij = sum_h (dσ² d² + dμ V) = sum_h d g + k_j  with  k_j = sum_h dμ_jh μ_jh
        dw = B.moments_backward(d, w, dmu_t, dvar, dV)                       # sum_h d g = dw - k_j (N, P, I, C)
        del d
        # k_j, the same for every i, would cancel in dw - sum_i' dw w but for sum_i' w = r/(r + ε):
        # its share is added in closed form, k_j ε / (r_j + ε)², rather than added and taken away
        # again (in float32, rounding the large k_j would swamp the rest)
        k = xp.sum(dmu_t * mu, axis=-1) * eps / (r + eps) ** 2
        dRp = (dw - xp.sum(dw * w, axis=2, keepdims=True)) / (r[:, :, None] + eps) + (dr + k)[:, :, None]
        da_in += xp.sum(dRp * R, axis=-1)
        dR = dRp * a_in[..., None]
    return dV, da_in, dbeta_u, dbeta_a
