"""Dynamic routing between capsules (Sabour et al. 2017, Procedure 1) and its exact backward.

Shapes (I input capsules, N samples, J output capsules, D output dims):
    u_hat  û_j|i  (I, N, J, D)   predictions; i leads so that W_ij u_i is one batched matmul over i
    b      b_ij   (N, J, I)      routing logits, per sample (never averaged over the batch)
    c      c_ij   (N, J, I)      coupling coefficients, softmax of b_ij over the output capsules j
(b and c keep i last: the softmax over j then runs across whole rows, and the sums over i and the
backward's stacked outer products read them as contiguous (N, J) batches of length-I vectors)
    s      s_j    (N, J, D)      weighted sum of predictions
    v      v_j    (N, J, D)      squashed output capsules

Forward, for r = 0 .. R-1 (b^0 = 0, so c^0 = 1/J and s^0 is a plain sum over i):
    c^r = softmax_j(b^r)
    s^r = sum_i c^r_ij û_j|i
    v^r = squash(s^r)
    b^{r+1} = b^r + û_j|i . v^r          (only for r < R-1)
The output is v^{R-1}.  With a learned bias β_j (D) per output capsule (the paper's published code
has one, starting at 0.1), every iteration's s^r = sum_i c^r_ij û_j|i + β_j.

Backward, mode "full" -- the exact gradient through every iteration.  Walk r from R-1 down to 0
carrying db = dL/db^{r+1}  (zero at r = R-1, where dL/dv^{R-1} is the incoming gradient):
    dv^r   = sum_i db_ij û_j|i               (r < R-1: v^r reaches the loss only through b^{r+1})
    ds^r   = squash_backward(s^r, dv^r)
    dc^r   = û_j|i . ds^r
    db    += c^r (dc^r - sum_j c^r dc^r)      (softmax backward; b^r feeds b^{r+1} with slope 1)
and û collects one outer product from every place it was used:
    dû_j|i = sum_r c^r_ij ds^r_j  +  sum_{r<R-1} db^{r+1}_ij v^r_j
(formed in a single pass at the end: B.outer_sum).
At r = 0 the logits b^0 = 0 are constants, so dc^0 and db^0 are not needed.  The bias, added to
every s^r, collects dβ_j = sum_r sum_n ds^r_j.

Backward, mode "final" -- the coupling coefficients c^{R-1} are treated as constants (as if the
routing loop ran under stop-gradient), and the gradient flows through the last weighted sum only:
    dû_j|i = c^{R-1}_ij ds^{R-1}_j
This is the exact gradient of that detached function (tests compare it with autograd on it).

The three products -- s_j = sum_i c_ij û_j|i, the agreement û_j|i . v_j and the sum of outer
products -- are named backend operations (B.weighted_sum, B.agreement, B.outer_sum): one plain form
in backends/capsule_ops.py, and faster ones where a backend has them.
"""
from __future__ import annotations

import numpy as np

from .fusable import fusable
from .routing_contract import Routing
from .squash import squash, squash_backward

MODES = ("full", "final")


@fusable
def softmax(xp, b, axis=1):
    """Softmax stabilised by subtracting the max (softmax(b) = softmax(b - max b))."""
    e = xp.exp(b - xp.max(b, axis=axis, keepdims=True))
    return e / xp.sum(e, axis=axis, keepdims=True)


@fusable
def softmax_backward(xp, c, dc, axis=1):
    """db = c * (dc - sum_j c dc), from dc_k/db_j = c_k (delta_kj - c_j)."""
    return c * (dc - xp.sum(c * dc, axis=axis, keepdims=True))


def routing_forward(B, u_hat, iters: int, fixed_coupling=None, bias=None):
    """Returns (v, trace); trace keeps (c^r, s^r, |s^r|, v^r) of every iteration for the backward
    (and for inspection: ``trace[r][0]`` are the coupling coefficients of iteration r).

    ``fixed_coupling`` (N, J, I): use these c_ij in the last iteration instead of softmax(b) -- the
    function whose exact gradient the "final" mode computes (gradient checks perturb it).
    ``bias`` (J, D) or None: β_j, added to every iteration's s_j."""
    xp = B.xp
    n_in, n, n_out, _ = u_hat.shape
    b = None  # b^0 = 0
    trace = []
    for r in range(iters):
        last = r == iters - 1
        fixed = last and fixed_coupling is not None
        if b is None and not fixed:  # c^0 = softmax(0) = 1/J for every i, j: s^0 is a plain sum
            c = B.zeros((n, n_out, n_in)) + 1.0 / n_out
            s = xp.sum(u_hat, axis=0) / n_out
        else:
            c = fixed_coupling if fixed else softmax(xp, b)  # (N, J, I)
            s = B.weighted_sum(c, u_hat)                  # s_j = sum_i c_ij û_j|i
        if bias is not None:
            s = s + bias                                  # s_j + β_j, the same for every sample
        v, s_norm = squash(xp, s)
        trace.append((c, s, s_norm, v))
        if not last:
            agreement = B.agreement(u_hat, v)             # û_j|i . v_j
            b = agreement if b is None else b + agreement
    return v, trace


def routing_backward_factors(B, u_hat, trace, dv, mode: str = "full", bias_grad: bool = False):
    """The backward from dL/dv (N, J, D) up to dL/dû (I, N, J, D), which is a sum of outer
    products: returns the lists (coeffs, vecs),
    coeffs[q] (N, J, I) and vecs[q] (N, J, D), of its terms (``B.outer_sum`` sums them).
    Kept apart so that a caller can free û, whose last use this is, before dû is made.
    ``bias_grad``: also return dβ (J, D), the gradient of a bias routing_forward added."""
    xp = B.xp
    if mode == "final":
        c, s, s_norm, _ = trace[-1]
        ds = squash_backward(xp, s, s_norm, dv)
        return ([c], [ds], xp.sum(ds, axis=0)) if bias_grad else ([c], [ds])  # dû_j|i = c_ij ds_j
    if mode != "full":
        raise ValueError(f"unknown routing gradient mode {mode!r}: use one of {MODES}")
    coeffs, vecs = [], []  # dû = sum_q coeffs[q] (x) vecs[q]
    db = None              # dL/db^{r+1}
    dbias = None           # sum over the iterations of ds^r (N, J, D)
    for r in reversed(range(len(trace))):
        c, s, s_norm, v = trace[r]
        if db is not None:
            dv = B.weighted_sum(db, u_hat)
            coeffs.append(db)
            vecs.append(v)
        ds = squash_backward(xp, s, s_norm, dv)
        coeffs.append(c)
        vecs.append(ds)
        if bias_grad:
            dbias = ds if dbias is None else dbias + ds
        if r > 0:
            dc = B.agreement(u_hat, ds)
            db_r = softmax_backward(xp, c, dc)
            db = db_r if db is None else db + db_r
    return (coeffs, vecs, xp.sum(dbias, axis=0)) if bias_grad else (coeffs, vecs)


class Dynamic(Routing):
    """Dynamic routing (Procedure 1 above), with the optional learned bias β_j on every s_j."""
    name, iterated, modes = "dynamic", True, ("full", "final")
    takes_bias = routes_shared = True

    def forward(self, B, u_hat, p, u, fixed=None):
        return routing_forward(B, u_hat, self.iters, fixed_coupling=fixed, bias=p.get("bias"))

    def backward(self, B, u_hat, u, trace, dv, p):
        factors, grads = self._factors(B, u_hat, trace, dv, p)
        return B.outer_sum(*factors), grads, None

    def backward_into(self, B, u_hat, u, trace, dv, p, out):
        factors, grads = self._factors(B, u_hat, trace, dv, p)
        B.outer_sum(*factors, out=out)  # the factors do not read û: dû may take its memory
        return grads, None

    def _factors(self, B, u_hat, trace, dv, p):
        if "bias" not in p:
            return routing_backward_factors(B, u_hat, trace, dv, self.gradient_mode), {}
        coeffs, vecs, dbias = routing_backward_factors(B, u_hat, trace, dv, self.gradient_mode, bias_grad=True)
        return (coeffs, vecs), {"bias": dbias}

    @property
    def gradient_mode(self) -> str:
        return self.mode

    def coupling(self, trace) -> list:
        return [c for c, *_ in trace]


class Uniform(Dynamic):
    """c_ij = 1/J, one pass: no routing at all (Paik, Kwak & Kim 2019's baseline)."""
    name, iterated = "uniform", False


class Random(Dynamic):
    """c_ij = softmax_j of N(0, 1) logits drawn for every problem from the layer's seeded generator,
    one pass, held constant in backward (Paik et al.'s other baseline): the layer passes the draw
    as ``fixed``, and the gradient is the "final" mode's whichever mode is asked for."""
    name, iterated, draws, routes_shared = "random", False, True, False

    @property
    def gradient_mode(self) -> str:
        return "final"

    def draw(self, B, rng, n, J, I):
        """c (n, J, I): softmax over j of N(0, 1) logits, drawn on the host (every backend the same)."""
        z = rng.standard_normal((n, J, I))
        e = np.exp(z - z.max(axis=1, keepdims=True))
        return B.asarray(e / e.sum(axis=1, keepdims=True))
