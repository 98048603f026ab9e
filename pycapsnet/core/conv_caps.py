"""ConvCaps: convolutional vector capsules with dynamic routing.

Children u_i sit on an (H, W) grid, T types of K dims.  A parent capsule of type j at output position
p = (oh, ow) routes from the K_s x K_s window of children under it (stride s):

    i = (kernel row, kernel column, child type)   I = K_s*K_s*T children per window
    û_j|i,p = W_ij u_(window p, i)                 W: (I, C, D, K), shared over positions p
    v_j,p   = dynamic routing (routing.py) of û_.|.,p among the C parent types at p

Which parents compete for a child: the parents at the same position.  The coupling coefficients of
a child's copy in window p are a softmax over the C parent types at p, so they sum to 1 there; a
child that lies in several windows (stride < kernel) sends each window an independent copy, routed
on its own.  (ConvMatrixCaps normalises a child's assignments over every window instead.)  Every
window of every sample is thus one routing problem: routing.py's code runs unchanged with the
batch axis N*P, and so does its exact backward, in both gradient modes:

    forward:   U = im2col(u) (N*P, I*K);   û = W U  per child slot i;   v = route(û)
    backward:  dû = routing_backward (B.outer_sum of its factors)
               dW_ij = sum_(n,p) dû_j|i,p u_(window p, i)^T;   dU_i = sum_j W_ij^T dû_j|i;   du = col2im(dU)

(col2im, the adjoint of im2col, adds each window's gradient back onto the children it covers.)
docs/backprop.md derives it beside the fully connected form.
"""
from __future__ import annotations

import numpy as np

from . import init as initializers
from .layers import Layer, check_input
from . import routing_calls, routings


class ConvCaps(Layer):
    """u (N, H*W, T, K) on an (H, W) grid -> v (N, OH*OW, C, D) on the (OH, OW) grid of windows."""

    def __init__(self, backend, grid, in_types, in_dim, out_types, out_dim, kernel=3, stride=1, iters=None,
                 routing_grad="full", rng=None, init_std=None, routing="dynamic", **routing_options):
        super().__init__(backend)
        self.grid, self.T, self.K, self.C, self.D = tuple(grid), in_types, in_dim, out_types, out_dim
        self.J = out_types  # the parents a child's coefficients range over: the C types at its window
        self.k, self.stride = kernel, stride
        h, w = self.grid
        self.oh, self.ow = (h - kernel) // stride + 1, (w - kernel) // stride + 1
        self.I = kernel * kernel * in_types
        rng = rng if rng is not None else np.random.default_rng(0)
        std = initializers.routed_std(self.I, out_types, out_dim) if init_std is None else init_std
        self._add_param("W", initializers.capsule_transform(rng, (self.I, out_types, out_dim, in_dim), std))
        self.trace = None
        routings.set_routing(self, routing, iters, routing_grad, routing_options, rng, lead=(self.I,))

    def forward(self, u):
        xp, B = self.B.xp, self.B
        n, (h, w), P = u.shape[0], self.grid, self.oh * self.ow
        check_input("ConvCaps", u, f"u (N, {h * w}, {self.T}, {self.K}): a {h}x{w} grid of {self.T} capsule types "
                    f"of {self.K}D", size=h * w * self.T * self.K)
        cols = B.im2col(xp.reshape(u, (n, h, w, self.T * self.K)), self.k, self.k, self.stride)  # (N*P, I*K)
        ut = xp.permute_dims(xp.reshape(cols, (n * P, self.I, self.K)), (1, 0, 2))               # (I, N*P, K)
        Wm = xp.reshape(self.params["W"], (self.I, self.C * self.D, self.K))
        u_hat = B.matmul(ut, xp.matrix_transpose(Wm))                                            # (I, N*P, C*D)
        u_hat = B.contiguous(xp.reshape(u_hat, (self.I, n * P, self.C, self.D)))                 # û (I, N*P, C, D)
        kids = ut if self.algo.reads_children else None
        if self.algo.draws:
            self.drawn = routings.draw_coupling(self, n * P, self.I)
        self.cache = (ut, u_hat, n, kids)
        v, self.trace = self.route(u_hat)                                                        # v (N*P, C, D)
        return xp.reshape(v, (n, P, self.C, self.D))

    def route(self, u_hat, fixed=None):
        """The routing (routings.py) of û (I, N*P, C, D) (and the windows' children u (I, N*P, K)),
        every window at once: (v_j, the trace).  ``fixed``: the last coefficients, given ("final");
        a drawing routing's draw."""
        if fixed is None and self.algo.draws:
            fixed = self.drawn
        return routing_calls.run_forward(self.algo, self.B, u_hat, self.routing_param_values(), self.cache[3], fixed)

    def routing_param_values(self) -> dict:
        """The routing's own parameters (the per-child ones are (I, ...) already)."""
        return {k: self.params[k] for k in self.routing_param_names}

    def coefficients(self) -> list:
        """The routing's coefficients of each iteration of the last forward: (N*P, C, I)."""
        return routing_calls.run_coupling(self.algo, self.trace, None, self.C)

    def routing_measures(self) -> dict:
        """The routing's own measures of the last forward (Routing.measures), {name: [per iteration]}."""
        return routing_calls.run_measures(self.algo, self.B, self.trace)

    def last_coefficients(self):
        return self.coefficients()[-1]

    @property
    def coupling(self):
        """c_ij of each routing iteration of the last forward, (N, P, I, C) arrays."""
        return [self.coupling_layout(c) for c in self.coefficients()]

    def coupling_layout(self, c):
        """Coefficients as the routing holds them (N*P, C, I) -> as ``coupling`` gives them (N, P, I, C)."""
        xp = self.B.xp
        return xp.reshape(xp.permute_dims(self.B.asarray(c), (0, 2, 1)), (-1, self.oh * self.ow, self.I, self.C))

    def backward(self, dv, input_grad=True):
        xp, B = self.B.xp, self.B
        ut, u_hat, n, kids = self.cache
        self.cache = None
        P = self.oh * self.ow
        dv = xp.reshape(dv, (n * P, self.C, self.D))
        grads, du_kids = routing_calls.run_backward(self.algo, B, u_hat, kids, self.trace, dv, self.routing_param_values(),
                                               out=u_hat)
        for k, g in grads.items():
            self.grads[k] += g
        d_u_hat = u_hat  # dû, written over û (its last use)
        d_u_hat = xp.reshape(d_u_hat, (self.I, n * P, self.C * self.D))                        # dû
        self.grads["W"] += xp.reshape(B.matmul(xp.matrix_transpose(d_u_hat), ut), self.params["W"].shape)
        if not input_grad:
            return None
        Wm = xp.reshape(self.params["W"], (self.I, self.C * self.D, self.K))
        dut = B.matmul(d_u_hat, Wm)                                                              # (I, N*P, K)
        if du_kids is not None:  # what the routing read of the window's children themselves
            dut = dut + du_kids
        dcols = xp.reshape(xp.permute_dims(dut, (1, 0, 2)), (n * P, self.I * self.K))
        h, w = self.grid
        du = B.col2im(dcols, (n, h, w, self.T * self.K), self.k, self.k, self.stride)
        return xp.reshape(du, (n, h * w, self.T, self.K))
