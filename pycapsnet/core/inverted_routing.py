"""Inverted dot-product attention routing (Tsai, Srivastava, Goh & Salakhutdinov, ICLR 2020) and its
exact backward.

Shapes as in routing.py: votes v_ij -- û_j|i here -- (I, N, J, D); agreements a, routing
coefficients r (N, J, I); s, parent poses p (N, J, D); the layer norm's γ, β (D,), shared by every
parent.  The parents query their children ("inverted"): a child's coefficients are a softmax over
the parents j, as dynamic routing's, but the agreement is with the parents' normalised poses.

Forward, for t = 0 .. T-1, from p^{-1} = 0 (so that a^0 = 0 and r^0 = 1/J: the first pass is uniform):
    a^t_ij = k p^{t-1}_j . û_j|i            k = 1/√D (``scaled``, the default) or 1
    r^t_ij = softmax_j(a^t_ij)
    s^t_j  = Σ_i r^t_ij û_j|i
    p^t_j  = LayerNorm(s^t_j) = γ (s - mean s) / √(var s + ε) + β     (over the D components)
The output is p^{T-1}.  The paper's equation has no k; its public code divides by √D.  The scaled
form is the default: a pose after layer norm has components of unit spread, so p . û grows like
√D |û| and would saturate the softmax for wide capsules; the published results were obtained with it.

Backward, mode "full", from dp = dL/dp^{T-1}, walking t from T-1 down to 0 with dp = dL/dp^t:
    ds^t, dγ, dβ = layer_norm_backward(s^t, dp)         (layer_norm.py; dγ, dβ add over t)
    dr^t_ij = û_j|i . ds^t_j
    da^t    = softmax_backward(r^t, dr^t)                (t > 0; at t = 0 the coefficients are constant)
    dp^{t-1}_j = k Σ_i da^t_ij û_j|i                     (p^{t-1} reaches the loss only through a^t)
and û collects an outer product from every place it was used:
    dû_j|i = Σ_t r^t_ij ds^t_j + Σ_{t>0} k da^t_ij p^{t-1}_j        (B.outer_sum)
Mode "final" holds r^{T-1} constant: dû = r^{T-1} ⊗ ds^{T-1}, and γ, β learn from the last pass.
"""
from __future__ import annotations

import math

import numpy as np

from .layer_norm import layer_norm, layer_norm_backward
from .routing import softmax, softmax_backward
from .routing_contract import Routing

EPS = 1e-5  # the layer norm's ε (PyTorch's default, which the public code uses)


def agreement_scale(D: int, scaled: bool) -> float:
    return 1 / math.sqrt(D) if scaled else 1.0


def inverted_forward(B, u_hat, gamma, beta, iters: int, scaled: bool = True, fixed=None):
    """û (I, N, J, D) -> (p (N, J, D), trace [(r^t, the layer norm's saved (x̂, 1/σ), p^{t-1})]).
    ``fixed`` (N, J, I): the last pass's coefficients, given (the function "final" differentiates)."""
    xp = B.xp
    n_in, n, J, D = u_hat.shape
    k = agreement_scale(D, scaled)
    p, trace = None, []
    for t in range(iters):
        if t == iters - 1 and fixed is not None:
            r = fixed
        elif p is None:
            r = B.zeros((n, J, n_in)) + 1.0 / J
        else:
            r = softmax(xp, k * B.agreement(u_hat, p), axis=1)
        s = B.weighted_sum(r, u_hat)
        p_next, saved = layer_norm(xp, s, gamma, beta, EPS)
        trace.append((r, saved, p))
        p = p_next
    return p, trace


def inverted_backward(B, u_hat, trace, dp, gamma, mode: str = "full", scaled: bool = True):
    """From dL/dp: (dû (I, N, J, D), {"gamma": dγ, "beta": dβ})."""
    xp = B.xp
    k = agreement_scale(u_hat.shape[-1], scaled)
    coeffs, vecs, dgamma, dbeta = [], [], 0, 0
    for t in reversed(range(len(trace))):
        r, saved, p_prev = trace[t]
        ds, dg, db = layer_norm_backward(xp, saved, gamma, dp)
        dgamma, dbeta = dgamma + dg, dbeta + db
        coeffs.append(r)
        vecs.append(ds)
        if mode == "final" or t == 0:
            break
        da = k * softmax_backward(xp, r, B.agreement(u_hat, ds))   # k dL/da^t
        coeffs.append(da)
        vecs.append(p_prev)
        dp = B.weighted_sum(da, u_hat)                              # dL/dp^{t-1}
    return B.outer_sum(coeffs, vecs), {"gamma": dgamma, "beta": dbeta}


def inverted_coupling(trace) -> list:
    """r^t (N, J, I) of every pass."""
    return [r for r, _, _ in trace]


class Inverted(Routing):
    """Inverted dot-product attention; the paper's network ends in a shared linear map to logits."""
    name, iterated, modes, symbol = "inverted", True, ("full", "final"), "r_ij"
    options = {"scaled": True}
    head = ("logits", "cross_entropy")

    def params(self, lead, J, D, K) -> dict:
        return {"gamma": np.ones(D), "beta": np.zeros(D)}  # the layer norm's affine, shared by the parents

    def forward(self, B, u_hat, p, u, fixed=None):
        return inverted_forward(B, u_hat, p["gamma"], p["beta"], self.iters, self.options["scaled"], fixed)

    def backward(self, B, u_hat, u, trace, dv, p):
        du_hat, grads = inverted_backward(B, u_hat, trace, dv, p["gamma"], self.mode, self.options["scaled"])
        return du_hat, grads, None

    def coupling(self, trace) -> list:
        return inverted_coupling(trace)
