"""Matrix capsules with EM routing (Hinton, Sabour & Frosst 2018): PrimaryMatrixCaps, ConvMatrixCaps,
ClassMatrixCaps.

A capsule is a 4x4 pose matrix M (kept flat, 16 entries, row-major) and an activation a in (0, 1).
A layer passes the pair (M, a) on a channels-last grid: M (N, H, W, T, 16), a (N, H, W, T).  A child i
votes for a parent j through a learned 4x4 transform, V_ij = M_i W_ij (``B.votes``), and EM routing
(em_routing.py) turns the votes into the parents' poses μ_j and activations a_j.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import CapsNetError
from .em_routing import MODES, Identity, em_backward, em_forward, inverse_temperatures
from .layers import Layer, Linear, check_input, sigmoid


def transform_init(rng, shape):
    """W_ij: N(0, 0.5^2) entries, so that a vote M_i W_ij (a sum of 4 products) keeps the scale of M_i."""
    return 0.5 * rng.standard_normal(shape)


class WindowGroup:
    """Which slots of a convolutional capsule layer are the same child (em_routing's ``group``).

    Slot (p, i), i = (kernel row, kernel column, child type), of an (N, P, I) array is the child that
    window p covers at that offset.  sum / max: over the slots of each child, handed back to every
    slot (the backend's window_sum and window_max).  copies: how many slots hold each slot's child,
    (1, P, I, 1), to broadcast against assignments (N, P, I, C)."""

    def __init__(self, B, in_shape, kernel, stride, copies=None):
        self.B, self.shape, self.k, self.s = B, tuple(in_shape), kernel, stride  # in_shape (N, H, W, T)
        n, h, w, _ = self.shape
        self.oh, self.ow = (h - kernel) // stride + 1, (w - kernel) // stride + 1
        self._copies = copies  # the same for every sample: made once, shared with the parts

    def part(self, sl, n):
        """The group of samples ``sl`` of a batch of n."""
        size = len(range(*sl.indices(n)))
        return self if size == self.shape[0] else WindowGroup(self.B, (size, *self.shape[1:]), self.k, self.s,
                                                              self.copies())

    def sum(self, x):
        return self.B.window_sum(x, self.shape, self.k, self.s)

    def max(self, x):
        return self.B.window_max(x, self.shape, self.k, self.s)

    def copies(self):
        if self._copies is None:
            _, h, w, t = self.shape
            ones = self.B.zeros((1, self.oh * self.ow, self.k * self.k * t)) + 1
            self._copies = self.B.window_sum(ones, (1, h, w, t), self.k, self.s)[..., None]
        return self._copies


def check_poses(name: str, x, types: int, least: int = 1, grid=None):
    """x must be (M (N, H, W, T, 16), a (N, H, W, T)) with T = ``types``, H and W at least ``least``
    (a window's size) or exactly ``grid``: else one line naming the layer and what it takes."""
    hw = "H, W" if grid is None else f"{grid[0]}, {grid[1]}"
    takes = f"(M (N, {hw}, {types}, 16), a (N, {hw}, {types}))" + (f", H and W at least {least}" if least > 1 else "")
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        raise CapsNetError(f"{name} takes a pair {takes}; got {type(x).__name__}")
    m, a = tuple(x[0].shape), tuple(x[1].shape)
    if len(m) != 5 or m[3:] != (types, 16) or a != m[:4] or min(m[1:3]) < least or \
            (grid is not None and m[1:3] != tuple(grid)):
        raise CapsNetError(f"{name} takes {takes}; got M {m}, a {a}")


class PrimaryMatrixCaps(Layer):
    """A 1x1 convolution from C_in channels to T capsule types: 16 pose entries and an activation
    logit per type, a = sigmoid(logit).  h (N, H, W, C_in) -> (M (N, H, W, T, 16), a (N, H, W, T)).

    The linear layer's T*17 output columns: first every type's 16 pose entries, type by type
    (columns 16t .. 16t + 15, the 4x4 pose row by row), then the T activation logits (column
    16T + t for type t)."""

    pose_scale = 8.0  # the pose columns' initial weights, times the fan-in initialisation's

    def __init__(self, backend, c_in, types=8, rng=None):
        super().__init__(backend)
        self.types = types
        self.linear = Linear(backend, c_in, types * 17, rng=rng)  # columns: T*16 pose entries, then T logits
        self.params, self.grads = self.linear.params, self.linear.grads
        # Poses of about unit size at the start, so that the votes' variances start near 1 in every
        # routed layer.  From the fan-in initialisation they would start far below it, ln σ² << 0,
        # and the cost r_j sum_h ½ ln σ²_jh would then push every activation to 1 (a(1 - a) ~ 0: no gradient).
        for name in ("W", "b"):
            self.params[name][..., :types * 16] *= self.pose_scale

    def forward(self, h):
        xp = self.B.xp
        check_input("PrimaryMatrixCaps", h, f"h (N, H, W, {self.linear.n_in})", self.linear.n_in, ndim=4)
        n, hh, ww, c = h.shape
        y = self.linear.forward(xp.reshape(h, (n * hh * ww, c)))
        t = self.types
        M = xp.reshape(y[:, :t * 16], (n, hh, ww, t, 16))
        logit = xp.reshape(y[:, t * 16:], (n, hh, ww, t))
        self.cache = (logit, tuple(h.shape))
        return M, sigmoid(xp, logit)

    def backward(self, d, input_grad=True):
        dM, da = d
        xp = self.B.xp
        logit, h_shape = self.cache
        self.cache = None
        rows = h_shape[0] * h_shape[1] * h_shape[2]
        # sigmoid' = a (1 - a) = sigmoid(z) sigmoid(-z): from the logit, so that an activation that
        # rounds to 1 (z > ~37 in float64) keeps its exact slope e^-z instead of 1 - a = 0
        dlogit = da * sigmoid(xp, logit) * sigmoid(xp, -logit)
        dy = xp.concat([xp.reshape(dM, (rows, -1)), xp.reshape(dlogit, (rows, -1))], axis=1)
        dh = self.linear.backward(dy, input_grad)
        return xp.reshape(dh, h_shape) if input_grad else None


class EMLayer(Layer):
    """What the two routed layers share: W, β_u, β_a, the routing settings and the EM trace.

    β_a is learned as λβ_a (the parameter ``lambda_beta_a``, λ the last iteration's): the logit that
    a parent's activation has when it costs nothing.  The function is the paper's; only what the
    optimizer steps changes.  With λ = 1e-3, the paper's β_a must travel thousands of units for a
    parent that receives little (a wrong class) to be switched off, and an optimizer that steps a
    few thousandths per update never gets there: those activations stay at sigmoid(0) = ½ and the
    spread loss's margin is out of reach (docs/performance.md, "The three routings")."""

    eps = 1e-6        # ε of the M-step's division by r_j
    var_eps = 1e-6  # the ε added to every σ²_jh (not a floor: σ² + ε, however large σ² is)

    def __init__(self, backend, n_slots, out_types, iters, routing_grad, lam, rng):
        super().__init__(backend)
        if routing_grad not in MODES:
            raise ValueError(f"unknown routing gradient mode {routing_grad!r}: use one of {MODES}")
        if iters < 1:
            raise ValueError(f"routing needs at least one iteration, got {iters}")
        rng = rng if rng is not None else np.random.default_rng(0)
        self.iters, self.routing_grad, self.lambdas = iters, routing_grad, inverse_temperatures(lam, iters)
        self._add_param("W", transform_init(rng, (n_slots, out_types, 4, 4)))
        self._add_param("beta_u", np.zeros(out_types))
        self._add_param("lambda_beta_a", np.zeros(out_types))
        self.trace = None

    def route(self, V, a_in, group):
        """EM routing of votes V (N, P, I, C, 16) from a_in (N, P, I): (μ (N, P, C, 16), a (N, P, C)).
        Each sample routes on its own, so the batch is split into blocks that keep the routing's
        temporaries in cache, spread over the backend's host threads (B.split_batch; one part on the
        GPUs); self.trace holds (slice, trace) per part."""
        B = self.B
        n, p, _, c, _ = V.shape
        mu, a = B.empty((n, p, c, 16)), B.empty((n, p, c))
        beta_a = self.params["lambda_beta_a"] / self.lambdas[-1]
        parts = []

        def run(sl):
            mu[sl], a[sl], trace = self.route_part(V[sl], a_in[sl], beta_a, group.part(sl, n), sl)
            parts.append((sl, trace))

        B.split_batch(run, n, math.prod(V.shape[1:]))
        self.trace = sorted(parts, key=lambda part: part[0].start or 0)
        return mu, a

    def route_part(self, V, a_in, beta_a, group, sl):
        """EM routing of the samples ``sl`` of the batch (em_routing.py): (μ, a, trace)."""
        return em_forward(self.B, V, a_in, self.params["beta_u"], beta_a, self.lambdas, self.eps, group,
                          var_eps=self.var_eps)

    def route_backward(self, V, a_in, group, dmu, da):
        """dV and da_in; adds dβ_u and d(λβ_a) = dβ_a / λ."""
        B = self.B
        dV, da_in, dbeta = B.empty(tuple(V.shape)), B.empty(tuple(a_in.shape)), []

        def run(sl):
            trace = next(t for s, t in self.trace if s == sl)
            _, da_in[sl], dbu, dba = em_backward(B, V[sl], a_in[sl], self.params["beta_u"], self.lambdas, trace,
                                                 dmu[sl], da[sl], self.eps, group.part(sl, V.shape[0]),
                                                 self.routing_grad, out=dV[sl])
            dbeta.append((sl.start or 0, dbu, dba))

        B.split_batch(run, V.shape[0], math.prod(V.shape[1:]))
        for _, dbu, dba in sorted(dbeta, key=lambda part: part[0]):  # in batch order, whichever thread ended first
            self.grads["beta_u"] += dbu
            self.grads["lambda_beta_a"] += dba / self.lambdas[-1]
        return dV, da_in

    @property
    def assignments(self):
        """R_ij of every routing iteration of the last forward, (N, P, I, C) each."""
        return self.traced(0)

    @property
    def iteration_activations(self):
        """a_j after every iteration's M-step, (N, P, C) each."""
        return self.traced(5)


class ConvMatrixCaps(EMLayer):
    """Convolutional capsules: each K x K window of child capsules (stride s) is routed to C parent
    types at the window's position.  W (K*K*T_in, C, 4, 4): one transform per (kernel offset, child
    type) and parent type, shared over positions.

    A child lies in the windows of several parent positions, and EM routing normalises its
    assignments over all of them: sum over every parent (position and type) that receives child i
    of R_ij = 1, as in the paper, so parents at neighbouring positions compete for a child as
    parents of different types at one position do (WindowGroup names the slots of each child).
    (M (N, H, W, T_in, 16), a (N, H, W, T_in)) -> (M (N, OH, OW, C, 16), a (N, OH, OW, C))."""

    def __init__(self, backend, in_types, out_types, kernel=3, stride=1, iters=3, routing_grad="full",
                 lam=1e-3, rng=None):
        super().__init__(backend, kernel * kernel * in_types, out_types, iters, routing_grad, lam, rng)
        self.k, self.stride, self.in_types, self.out_types = kernel, stride, in_types, out_types

    def forward(self, x):
        check_poses("ConvMatrixCaps", x, self.in_types, least=self.k)
        M, a = x
        xp, B = self.B.xp, self.B
        n, h, w, t, _ = M.shape
        group = WindowGroup(B, (n, h, w, t), self.k, self.stride)
        p = group.oh * group.ow
        Mw = xp.reshape(B.im2col(xp.reshape(M, (n, h, w, t * 16)), self.k, self.k, self.stride), (n, p, -1, 16))
        a_in = xp.reshape(B.im2col(a, self.k, self.k, self.stride), (n, p, -1))        # (N, P, I)
        V, Mi = B.votes(Mw, self.params["W"])                                           # (N, P, I, C, 16)
        mu, a_out = self.route(V, a_in, group)
        self.cache = (Mi, V, a_in, group)
        c = self.out_types
        return xp.reshape(mu, (n, group.oh, group.ow, c, 16)), xp.reshape(a_out, (n, group.oh, group.ow, c))

    def backward(self, d, input_grad=True):
        dM, da = d
        xp, B = self.B.xp, self.B
        Mi, V, a_in, group = self.cache
        self.cache = None
        n, p = V.shape[:2]
        dV, da_in = self.route_backward(V, a_in, group, xp.reshape(dM, (n, p, -1, 16)), xp.reshape(da, (n, p, -1)))
        dW, dMw = B.votes_backward(Mi, self.params["W"], dV)
        self.grads["W"] += dW
        if not input_grad:
            return None
        shape, k, s = group.shape, self.k, self.stride
        dM_in = B.col2im(xp.reshape(dMw, (n * p, -1)), (*shape[:3], shape[3] * 16), k, k, s)
        da_in = B.col2im(xp.reshape(da_in, (n * p, -1)), shape, k, k, s)
        return xp.reshape(dM_in, (*shape, 16)), da_in


class ClassMatrixCaps(EMLayer):
    """Class capsules: every child on the (GH, GW) grid votes for each of the J classes.
    W (T_in, J, 4, 4) is shared over positions (one transform per child type and class), and
    coordinate addition tells the parents where a vote came from: the scaled centre of the child's
    grid cell, (row + ½) / GH and (column + ½) / GW, is added to the first two entries of the vote's
    last column, in that order (entries (0, 3) and (1, 3)), as the paper says: "(row, column)".  The offsets are constants, so dV passes to W and
    M unchanged.  EM routing then runs with P = 1 and I = GH*GW*T_in children, each in one slot.
    (M (N, GH, GW, T_in, 16), a (N, GH, GW, T_in)) -> (μ (N, J, 16), a (N, J))."""

    def __init__(self, backend, grid, in_types, n_classes, iters=3, routing_grad="full", lam=1e-3, rng=None):
        super().__init__(backend, in_types, n_classes, iters, routing_grad, lam, rng)
        gh, gw = grid
        rows = np.broadcast_to(((np.arange(gh) + 0.5) / gh)[:, None], (gh, gw))  # entry (0, 3): the row
        cols = np.broadcast_to(((np.arange(gw) + 0.5) / gw)[None, :], (gh, gw))  # entry (1, 3): the column
        # (1, Q, 1, 1) each: added in place to entries 3 and 7 of the votes, which are new arrays (a
        # whole V + offsets would write a second V-sized array, the layer's largest)
        self.coordinates = tuple(backend.asarray(np.reshape(c, (1, gh * gw, 1, 1))) for c in (rows, cols))
        self.J, self.grid, self.in_types = n_classes, (gh, gw), in_types

    def forward(self, x):
        check_poses("ClassMatrixCaps", x, self.in_types, grid=self.grid)
        M, a = x
        xp, B = self.B.xp, self.B
        n, gh, gw, t, _ = M.shape
        V, Mi = B.votes(xp.reshape(M, (n, gh * gw, t, 16)), self.params["W"])   # (N, Q, T, J, 16)
        V[..., 3] += self.coordinates[0]
        V[..., 7] += self.coordinates[1]
        V = xp.reshape(V, (n, 1, gh * gw * t, self.J, 16))
        a_in = xp.reshape(a, (n, 1, gh * gw * t))
        mu, a_out = self.route(V, a_in, Identity)
        self.cache = (Mi, V, a_in, tuple(M.shape))
        return xp.reshape(mu, (n, self.J, 16)), xp.reshape(a_out, (n, self.J))

    def backward(self, d, input_grad=True):
        dmu, da = d
        xp, B = self.B.xp, self.B
        Mi, V, a_in, shape = self.cache
        self.cache = None
        n, gh, gw, t, _ = shape
        dV, da_in = self.route_backward(V, a_in, Identity, xp.reshape(dmu, (n, 1, self.J, 16)),
                                        xp.reshape(da, (n, 1, self.J)))
        dW, dM = B.votes_backward(Mi, self.params["W"], xp.reshape(dV, (n, gh * gw, t, self.J, 16)))
        self.grads["W"] += dW
        if not input_grad:
            return None
        return xp.reshape(dM, shape), xp.reshape(da_in, shape[:4])

    @property
    def coupling(self):
        """R_ij of each routing iteration of the last forward, as (N, I, J) arrays, i = (row, column,
        type) of the child grid: the layout of dynamic routing's c_ij, for the same pictures."""
        return [self.B.xp.reshape(R, (R.shape[0], R.shape[2], self.J)) for R in self.assignments]

    @property
    def activations(self):
        """a_j of each routing iteration's M-step, (N, J) arrays."""
        return [self.B.xp.reshape(a, (a.shape[0], self.J)) for a in self.iteration_activations]
