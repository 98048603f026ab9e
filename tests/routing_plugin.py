"""A routing defined outside the package, as a researcher's plugin would be (tests/test_routing_contract.py
puts it through everything a built-in routing goes through): "tempered", dynamic routing with a
temperature τ, learned prior logits (one per child slot and parent) and each child's vote weighed by
its length, so that it has options, a per-child parameter and reads the child capsules.

Shapes: û (I, n, J, D), u (I, n, K), gate g (I, J), a_i = |u_i| (n, I); b, c, w (n, J, I); s, v (n, J, D).

Forward, r = 0 .. R-1, from b^0_ij = g_ij:
    c^r = softmax_j(b^r / τ)      (the last iteration's given where ``fixed`` is)
    w^r = c^r a_i,   s^r = Σ_i w^r_ij û_j|i,   v^r = squash(s^r)
    b^{r+1} = b^r + û_j|i . v^r
Backward ("full"), from dv^{R-1} = dv, r = R-1 .. 0, with db = dL/db^{r+1} (0 at r = R-1):
    dv^r   = Σ_i db_ij û_j|i            (r < R-1)      dû += db ⊗ v^r
    ds^r   = squash_backward(s^r, dv^r)                 dû += w^r ⊗ ds^r
    dw     = û . ds^r,   da_i += Σ_j dw_ij c^r_ij,      dc = dw a_i
    db    += softmax_backward(c^r, dc) / τ              (b^r feeds b^{r+1} with slope 1)
    dg = Σ_n db (the gradient at b^0),   du_i = da_i u_i / |u_i|
"final": c^{R-1} constant: the last iteration alone, without db.
"""
import numpy as np

import pycapsnet.routings as R


@R.register
class Tempered(R.Routing):
    name, iterated, modes, reads_children, per_child = "tempered", True, ("full", "final"), True, ("gate",)
    options = {"temperature": 1.0, "weigh_by_length": True}

    def check_options(self, options, D):
        if not options["temperature"] > 0:
            raise ValueError(f"temperature must be above 0, got {options['temperature']}")

    def params(self, lead, J, D, K):
        return {"gate": np.zeros((*lead, J))}

    def _a(self, B, u):
        xp = B.xp
        if not self.options["weigh_by_length"]:
            return None
        return xp.matrix_transpose(xp.sqrt(xp.sum(u * u, axis=-1)))                 # (n, I)

    def forward(self, B, u_hat, p, u, fixed=None):
        xp, tau = B.xp, self.options["temperature"]
        a = self._a(B, u)
        b = xp.broadcast_to(xp.matrix_transpose(p["gate"])[None], (u_hat.shape[1], *p["gate"].shape[::-1]))
        trace = []
        for r in range(self.iters):
            last = r == self.iters - 1
            c = fixed if last and fixed is not None else R.softmax(xp, b / tau)
            w = c if a is None else c * a[:, None, :]
            s = B.weighted_sum(w, u_hat)
            v, s_norm = R.squash(xp, s)
            trace.append((c, w, s, s_norm, v))
            if not last:
                b = b + B.agreement(u_hat, v)
        return v, trace

    def backward(self, B, u_hat, u, trace, dv, p):
        xp, tau = B.xp, self.options["temperature"]
        a = self._a(B, u)
        coeffs, vecs, db, da = [], [], None, None
        steps = trace[-1:] if self.mode == "final" else trace
        for r in reversed(range(len(steps))):
            c, w, s, s_norm, v = steps[r]
            if db is not None:
                dv = B.weighted_sum(db, u_hat)
                coeffs.append(db)
                vecs.append(v)
            ds = R.squash_backward(xp, s, s_norm, dv)
            coeffs.append(w)
            vecs.append(ds)
            dw = B.agreement(u_hat, ds)
            if a is not None:
                da_r = xp.sum(dw * c, axis=1)
                da = da_r if da is None else da + da_r
            if self.mode == "full":
                dlogit = R.softmax_backward(xp, c, dw if a is None else dw * a[:, None, :]) / tau
                db = dlogit if db is None else db + dlogit
        grads = {"gate": xp.matrix_transpose(xp.sum(db, axis=0)) if db is not None else xp.zeros_like(p["gate"])}
        du = None
        if a is not None:
            size = xp.sqrt(xp.sum(u * u, axis=-1, keepdims=True))
            du = u * (xp.matrix_transpose(da)[..., None] / size)
        return B.outer_sum(coeffs, vecs), grads, du

    def coupling(self, trace):
        return [c for c, *_ in trace]


@R.register
class TemperedWrong(Tempered):
    """Its backward drops the routing's feedback (the gradient through the earlier iterations): the
    "final" form in "full" mode, which every check of the backward must catch."""
    name = "tempered-wrong"

    def backward(self, B, u_hat, u, trace, dv, p):
        mode, self.mode = self.mode, "final"
        try:
            du_hat, grads, du = super().backward(B, u_hat, u, trace, dv, p)
        finally:
            self.mode = mode
        return du_hat, grads, du


@R.register
class TemperedOneBackend(Tempered):
    """A backward that differs on one backend (as a backend-specific bug would: here, on PyTorch's, a
    relative 1e-6 too large): what the NumPy-against-PyTorch check catches."""
    name = "tempered-torch-bug"

    def backward(self, B, u_hat, u, trace, dv, p):
        du_hat, grads, du = super().backward(B, u_hat, u, trace, dv, p)
        return (du_hat * (1 + 1e-6) if B.name == "torch" else du_hat), grads, du
