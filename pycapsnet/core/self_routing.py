"""Self-routing (Hahn, Pyeon & Kim, NeurIPS 2019) and its exact backward.

No iterations and no agreement: each child decides by itself where its vote goes, through a
routing map of its own (a mixture of experts whose gate is the child).  Shapes: votes û_j|i
(I, N, J, D); the child poses u_i (I, N, K) and activations a_i (N, I); the routing map W^r (I, J, K)
and bias b^r (I, J), both starting at zero as in the paper (so every child starts uniform).

    logit_ij = W^r_ij . u_i + b^r_ij              (N, J, I)
    r_ij     = softmax_j(logit_ij)
    A_j      = Σ_i a_i r_ij,   a_j = A_j / Σ_i a_i   (parent activation: the children's share sent to j)
    w_ij     = a_i r_ij / A_j                          (each parent's weights over its children, sum 1)
    μ_j      = Σ_i w_ij û_j|i                          (parent pose)

A child's activation a_i here is its length |u_i| (a vector capsule's length says that its entity is
present: Sabour et al.'s convention, which lets these layers stack with the others), and the parent
emits v_j = a_j μ_j / |μ_j|: the pose's direction, with the activation as its length.  The
activations of a layer's parents sum to 1 over j, so a class layer's lengths are a distribution:
the paper's head is their negative log-likelihood (the loss "nll").

Backward from dv (N, J, D), with μ̂ = μ / |μ|:
    da_j = dv_j . μ̂_j,     dμ_j = a_j (dv_j - μ̂_j (μ̂_j . dv_j)) / |μ_j|
    dû_j|i = w_ij dμ_j,    dw_ij = û_j|i . dμ_j
    dA_j   = da_j / Σa - Σ_i dw_ij w_ij / A_j            (w = a r / A, a_j = A_j / Σa)
    d(a_i r_ij) = dw_ij / A_j + dA_j
    da_i   = Σ_j r_ij d(a r)_ij - Σ_j da_j A_j / (Σa)²
    dlogit = softmax_backward(r, a_i d(a r))
    dW^r_ij = Σ_n dlogit_ij u_i,  db^r_ij = Σ_n dlogit_ij,  du_i = Σ_j dlogit_ij W^r_ij + da_i u_i / |u_i|
"""
from __future__ import annotations

import numpy as np

from .routing import softmax, softmax_backward
from .routing_contract import Routing


def child_logits(B, u, W_r, b_r):
    """logit_ij = W^r_ij . u_i + b^r_ij:  u (I, N, K), W^r (I, J, K), b^r (I, J) -> (N, J, I)."""
    xp = B.xp
    z = B.matmul(u, xp.matrix_transpose(W_r)) + b_r[:, None, :]     # (I, N, J)
    return B.contiguous(xp.permute_dims(z, (1, 2, 0)))


def child_activations(xp, u):
    """a_i = |u_i|:  u (I, N, K) -> (N, I)."""
    return xp.matrix_transpose(xp.sqrt(xp.sum(u * u, axis=-1)))


def self_forward(B, u_hat, u, W_r, b_r):
    """û (I, N, J, D), u (I, N, K) -> (v (N, J, D), trace)."""
    xp = B.xp
    r = softmax(xp, child_logits(B, u, W_r, b_r), axis=1)            # (N, J, I)
    a_in = child_activations(xp, u)                                  # (N, I)
    total = xp.sum(a_in, axis=1)[:, None]                            # Σ_i a_i (N, 1)
    ar = r * a_in[:, None, :]
    A = xp.sum(ar, axis=2)                                           # (N, J)
    w = ar / A[..., None]
    mu = B.weighted_sum(w, u_hat)                                    # (N, J, D)
    norm = xp.sqrt(xp.sum(mu * mu, axis=-1))
    a_out = A / total
    direction = mu / norm[..., None]
    return direction * a_out[..., None], (r, a_in, total, A, w, direction, norm, a_out)


def self_backward(B, u_hat, u, trace, dv, W_r):
    """From dL/dv: (dû (I, N, J, D), {"W_route": dW^r (I, J, K), "b_route": db^r (I, J)}, du (I, N, K))."""
    xp = B.xp
    r, a_in, total, A, w, direction, norm, a_out = trace
    da_out = xp.sum(dv * direction, axis=-1)                                     # (N, J)
    dmu = (dv - direction * da_out[..., None]) * (a_out / norm)[..., None]
    du_hat = B.outer_sum([w], [dmu])
    dw = B.agreement(u_hat, dmu)                                                 # (N, J, I)
    dA = da_out / total - xp.sum(dw * w, axis=2) / A
    dar = dw / A[..., None] + dA[..., None]
    da_in = xp.sum(r * dar, axis=1) - xp.sum(da_out * A, axis=1)[:, None] / (total * total)
    dlogit = softmax_backward(xp, r, dar * a_in[:, None, :], axis=1)            # (N, J, I)
    g = xp.permute_dims(dlogit, (2, 0, 1))                                       # (I, N, J)
    dW = B.matmul(xp.matrix_transpose(g), u)                                     # (I, J, K)
    du = B.matmul(g, W_r)                                                        # (I, N, K)
    size = xp.sqrt(xp.sum(u * u, axis=-1, keepdims=True))
    safe = xp.where(size > 0, size, 1)
    du = du + xp.where(size > 0, u * (xp.matrix_transpose(da_in)[..., None] / safe), 0)
    return du_hat, {"W_route": dW, "b_route": xp.sum(g, axis=1)}, du


def self_coupling(trace) -> list:
    """The routing coefficients r_ij (N, J, I): one pass."""
    return [trace[0]]


class SelfRouting(Routing):
    """Self-routing: the coefficients come from each child alone, so there is no "final" mode (holding
    them constant would stop the routing map from learning); the paper's head is the NLL of the lengths."""
    name, reads_children, per_child, symbol = "self", True, ("W_route", "b_route"), "r_ij"
    head = ("lengths", "nll")

    def params(self, lead, J, D, K) -> dict:
        return {"W_route": np.zeros((*lead, J, K)), "b_route": np.zeros((*lead, J))}  # zero, as the paper's

    def forward(self, B, u_hat, p, u, fixed=None):
        return self_forward(B, u_hat, u, p["W_route"], p["b_route"])

    def backward(self, B, u_hat, u, trace, dv, p):
        return self_backward(B, u_hat, u, trace, dv, p["W_route"])

    def coupling(self, trace) -> list:
        return self_coupling(trace)
