"""Self-attention routing (Mazzia et al. 2021, Efficient-CapsNet) and its exact backward.

One pass, no iterations.  Shapes as in routing.py: û_j|i (I, N, J, D); scores, c, their gradients
(N, J, I); S, s, v (N, J, D); the learned bias β_ij (J, I), shared over the batch.

Forward:
    S_j   = sum_k û_j|k                        (every child's prediction for parent j)
    a_ij  = û_j|i . S_j / √D                   (agreement of child i with all children, self-attention)
    c_ij  = softmax_j(a_ij)                    (over the parents j, as dynamic routing's c_ij)
    s_j   = sum_i (c_ij + β_ij) û_j|i
    v_j   = squash_exp(s_j) = (1 - e^-|s_j|) s_j / |s_j|

Backward from dv:
    ds    = squash_exp_backward(s, dv)
    dĉ_ij = û_j|i . ds_j   (ĉ = c + β:  dβ_ij = sum_n dĉ_ij, dc = dĉ)
    da    = softmax_backward(c, dc) / √D        (the 1/√D folded in)
    dS_j  = sum_i da_ij û_j|i
and û collects three outer products: from s, from its own score and from S (which every score reads):
    dû_j|i = (c_ij + β_ij) ds_j + da_ij S_j + dS_j
(B.outer_sum with coefficients (ĉ, da, 1) and vectors (ds, S, dS)).
"""
from __future__ import annotations

import math

import numpy as np

from .routing import softmax, softmax_backward
from .routing_contract import Routing
from .squash import squash_exp, squash_exp_backward


def attention_forward(B, u_hat, bias):
    """u_hat (I, N, J, D), bias (J, I) -> (v (N, J, D), trace (S, c, ĉ, s, |s|))."""
    xp = B.xp
    S = xp.sum(u_hat, axis=0)                                      # S_j (N, J, D)
    c = softmax(xp, B.agreement(u_hat, S) / math.sqrt(u_hat.shape[-1]), axis=1)
    c_hat = c + bias
    s = B.weighted_sum(c_hat, u_hat)
    v, s_norm = squash_exp(xp, s)
    return v, (S, c, c_hat, s, s_norm)


def attention_backward_factors(B, u_hat, trace, dv):
    """From dL/dv: (the factors of dû for B.outer_sum, dL/dbias (J, I))."""
    xp = B.xp
    S, c, c_hat, s, s_norm = trace
    ds = squash_exp_backward(xp, s, s_norm, dv)
    dc = B.agreement(u_hat, ds)                                    # dĉ_ij = û_j|i . ds_j
    da = softmax_backward(xp, c, dc) / math.sqrt(u_hat.shape[-1])
    dS = B.weighted_sum(da, u_hat)
    ones = B.zeros(tuple(c.shape)) + 1
    return ([c_hat, da, ones], [ds, S, dS]), xp.sum(dc, axis=0)


class Attention(Routing):
    """Self-attention routing as a routing of the contract: β_ij one per child slot and parent
    (shared over positions with share_spatial), seen here as (I, J); its pictures show c_ij + β_ij."""
    name, per_child, symbol = "attention", ("bias",), "c_ij + β_ij"

    def params(self, lead, J, D, K) -> dict:
        return {"bias": np.zeros((*lead, J))}  # Efficient-CapsNet's start: the plain softmax

    def forward(self, B, u_hat, p, u, fixed=None):
        v, trace = attention_forward(B, u_hat, B.xp.matrix_transpose(p["bias"]))
        return v, [trace]  # one pass: a trace of one iteration

    def backward(self, B, u_hat, u, trace, dv, p):
        factors, dbias = attention_backward_factors(B, u_hat, trace[0], dv)
        return B.outer_sum(*factors), {"bias": B.xp.matrix_transpose(dbias)}, None

    def backward_into(self, B, u_hat, u, trace, dv, p, out):
        factors, dbias = attention_backward_factors(B, u_hat, trace[0], dv)
        B.outer_sum(*factors, out=out)
        return {"bias": B.xp.matrix_transpose(dbias)}, None

    def coupling(self, trace) -> list:
        return [trace[0][2]]  # ĉ = c + β
