"""Capsule layers: PrimaryCaps, ClassCaps (dynamic routing), AttentionCaps (self-attention routing) and
capsule lengths."""
from __future__ import annotations

import numpy as np

from . import init as initializers
from .depthwise import DepthwiseConv2d
from .fourier import FourierConv2d
from .layers import Conv2d, Layer, check_images, check_input
from . import routing_calls, routings, shared_routing
from .squash import squash, squash_backward, squash_exp, squash_exp_backward

# The squash of a capsule layer's output: Sabour et al.'s |s|²/(1 + |s|²) s/|s|, or Efficient-CapsNet's
# (1 - e^-|s|) s/|s| (squash.py derives both backward passes).
SQUASHES = {"sabour": (squash, squash_backward), "efficient": (squash_exp, squash_exp_backward)}


class PrimaryCaps(Layer):
    """One wide convolution whose T*K output channels regroup into T capsule types of K dims.

    x: (N, H, W, C_in) -> u_i: (N, P, T, K), P = OH*OW positions, i = (p, t).
    Channel t*K + k of position p is component k of capsule (p, t); with channels-last output the
    regrouping is a reshape, and u_i = squash(s_i) over k.

    ``conv``: "fourier" (default, ``FourierConv2d``: the same convolution with fewer multiply-adds
    at the paper's size) or "im2col" (``Conv2d``: the textbook form).  Both give the same
    parameters from the same rng and the same results to rounding.  "depthwise"
    (``DepthwiseConv2d``, Efficient-CapsNet's): one kernel per input channel, T*K = C_in.
    ``squash``: "sabour" (default) or "efficient" (SQUASHES).
    ``init_std``, ``bias``: the convolution's weights drawn N(0, init_std²) and its biases set to
    ``bias`` (init.given), else its defaults.  ``scale``: s = W * (scale x) + b, the convolution
    scaled and the bias not, as the paper's published code has it (scale 1/32); the convolution
    being linear in x, scaling x is scaling W * x, and backward scales dx by the same.
    """

    CONVS = {"fourier": FourierConv2d, "im2col": Conv2d, "depthwise": DepthwiseConv2d}
    FULL_CONVS = ("fourier", "im2col")  # those that mix channels: the built-in networks' choices (--primary-conv)

    def __init__(self, backend, c_in, types=32, dim=8, kernel=9, stride=2, rng=None, conv="fourier", squash="sabour",
                 init_std=None, bias=None, scale=1.0):
        super().__init__(backend)
        if conv not in self.CONVS:
            raise ValueError(f"unknown convolution {conv!r}: use one of {tuple(self.CONVS)}")
        if squash not in SQUASHES:
            raise ValueError(f"unknown squash {squash!r}: use one of {tuple(SQUASHES)}")
        self.types, self.dim, self.squash, self.scale = types, dim, squash, float(scale)
        self.conv = self.CONVS[conv](backend, c_in, types * dim, kernel, stride, rng=rng,
                                     init=initializers.given(initializers.uniform_fan_in, init_std, bias))
        self.params, self.grads = self.conv.params, self.conv.grads  # one set of parameters

    def forward(self, x):
        check_images("PrimaryCaps", x, self.conv)
        y = self.conv.forward(x if self.scale == 1 else x * self.scale)  # (N, OH, OW, T*K)
        n, oh, ow, _ = y.shape
        s = self.B.xp.reshape(y, (n, oh * ow, self.types, self.dim))
        u, s_norm = SQUASHES[self.squash][0](self.B.xp, s)
        self.cache = (s, s_norm, tuple(y.shape))
        return u

    def backward(self, du, input_grad=True):
        s, s_norm, y_shape = self.cache
        self.cache = None
        ds = SQUASHES[self.squash][1](self.B.xp, s, s_norm, du)
        dx = self.conv.backward(self.B.xp.reshape(ds, y_shape), input_grad)
        return dx if dx is None or self.scale == 1 else dx * self.scale


class ClassCaps(Layer):
    """Class capsules v_j from primary capsules u_i by dynamic routing.

    û_j|i = W_ij u_i with W: (P, T, J, D, K) -- one D x K matrix per (input capsule i = (p, t),
    class j).  With ``share_spatial`` W is (1, T, J, D, K): one transform per capsule *type*, shared
    over the P positions, so the parameter count no longer grows with the image size.

    Backward: from dû (routing_backward_factors, then B.outer_sum),
    dW_ij = sum_n dû_j|i u_i^T  (summed over positions too when shared)  and  du_i = sum_j W_ij^T dû_j|i.
    With ``share_spatial`` û is never formed: routing runs on u and the small per-type matrices
    (shared_routing.py), a chunk of positions at a time whose coupling coefficients (N, T, p, J)
    fill at most ``chunk_bytes``, so memory no longer grows with P x J x D.

    ``bias`` (a number, or None for none): a learned β_j (J, D) added to every routing iteration's
    s_j, starting at that value: the paper's published code has one, starting at 0.1.
    """

    chunk_bytes = 64 * 2**20
    routes_shared = True  # with share_spatial, route u and W without forming û (shared_routing.py)

    def __init__(self, backend, positions, types, in_dim, n_classes, out_dim, iters=None,
                 routing_grad="full", share_spatial=False, rng=None, init_std=0.01, bias=None, routing="dynamic",
                 **routing_options):
        super().__init__(backend)
        self.P, self.T, self.K, self.J, self.D = positions, types, in_dim, n_classes, out_dim
        self.share_spatial = share_spatial
        rng = rng if rng is not None else np.random.default_rng(0)
        shape = (1 if share_spatial else positions, types, n_classes, out_dim, in_dim)
        self._add_param("W", initializers.capsule_transform(rng, shape, init_std))
        self.s_bias = bias is not None
        if self.s_bias:
            if not routings.get(routing).takes_bias:
                raise ValueError(f"bias is dynamic routing's β_j on s_j; routing '{routing}' takes none")
            self._add_param("bias", np.full((n_classes, out_dim), float(bias)))   # β_j (J, D)
        self.trace = None
        routings.set_routing(self, routing, iters, routing_grad, routing_options, rng, lead=shape[:2])
        # share_spatial shares W (and a routing's own parameters); dynamic routing's own may route u and
        # the per-type W without forming û (shared_routing.py)
        self.routes_shared = self.algo.routes_shared

    def forward(self, u):
        # u: (N, P, T, K), or (N, T, K) from another routing layer (P = 1) -> v: (N, J, D)
        xp = self.B.xp
        n = u.shape[0]
        self.in_shape = tuple(u.shape)
        check_input("ClassCaps", u, f"u (N, {self.P}, {self.T}, {self.K}): {self.P} positions of {self.T} capsule "
                    f"types of {self.K}D", size=self.P * self.T * self.K)
        if len(self.in_shape) != 4:
            u = xp.reshape(u, (n, self.P, self.T, self.K))
        if self.share_spatial and self.routes_shared:
            ut = self.B.contiguous(xp.permute_dims(u, (0, 2, 1, 3)))             # (N, T, P, K)
            v, self.trace = self.route_shared(ut, self._shared_W())
            self.cache = ut
            return v
        ut = xp.permute_dims(u, (1, 2, 0, 3))                                   # (P, T, N, K)
        Wm = xp.reshape(self.params["W"], (-1, self.T, self.J * self.D, self.K))  # (P|1, T, J*D, K)
        # P*T small products (N x K) @ (K x J*D), laid out as the backend wants (B.predictions)
        u_hat = self.B.predictions(ut, self.B.contiguous(xp.matrix_transpose(Wm)))  # (P, T, N, J*D)
        u_hat = xp.reshape(u_hat, (self.P * self.T, n, self.J, self.D))          # û_j|i (I, N, J, D)
        kids = None  # the child capsules (I, N, K), for a routing that reads them
        if self.algo.reads_children:
            kids = self.B.contiguous(xp.reshape(ut, (self.P * self.T, n, self.K)))
        if self.algo.draws:
            self.drawn = routings.draw_coupling(self, n, self.P * self.T)
        self.cache = (ut, u_hat, kids)
        v, self.trace = self._route_blocks(u_hat)
        return v

    def route(self, u_hat, sl, fixed=None):
        """The routing (routings.py) of û (I, n, J, D), the samples ``sl`` of the batch (and their
        child capsules u (I, n, K)): (v_j, its trace).  ``fixed``: the whole batch's last
        coefficients, given ("final"); a drawing routing's draw."""
        kids = self.cache[2]
        if fixed is None and self.algo.draws:
            fixed = self.drawn
        return routing_calls.run_forward(self.algo, self.B, u_hat, self.routing_param_values(),
                                    None if kids is None else kids[:, sl], None if fixed is None else fixed[sl])

    def routing_param_values(self):
        """The routing's own parameters, those with an entry per child laid out as (I, ...), and β_j."""
        xp = self.B.xp
        out = {}
        for k in self.routing_param_names:
            p = self.params[k]
            if k in self.algo.per_child:
                p = xp.reshape(xp.broadcast_to(p, (self.P, self.T, *p.shape[2:])), (self.P * self.T, *p.shape[2:]))
            out[k] = p
        if self.s_bias:
            out["bias"] = self.params["bias"]
        return out

    # Every sample routes on its own.  So routing runs on blocks of the batch (B.split_batch): on the
    # CPU each block of û is one contiguous piece (B.route_block), small enough to stay in cache through
    # all of routing's passes over it, and the blocks are spread over the host threads; on a GPU, one
    # block: the batch.
    def _route_blocks(self, u_hat):
        """v_j (N, J, D), and per block of the batch (its slice, the trace ``route`` keeps for it), in
        batch order.  Backward reads each block's trace as it is (``traced`` joins them for a reader)."""
        B = self.B
        n = u_hat.shape[1]
        v, parts = B.empty((n, self.J, self.D)), []

        def run(sl):
            v[sl], trace = self.route(B.route_block(u_hat, sl), sl)
            parts.append((sl, trace))

        B.split_batch(run, n, self.P * self.T * self.J * self.D)
        return v, sorted(parts, key=lambda part: part[0].start or 0)

    def _route_blocks_backward(self, u_hat, dv):
        """dû (I, N, J, D), written over û (its last use), block by block as forward routed them;
        adds the routing's own parameter gradients, summed in batch order whichever block ends first."""
        B = self.B
        n, grads = u_hat.shape[1], []
        kids = self.cache[2]

        def run(sl):
            trace = next(t for s, t in self.trace if s == sl)  # the same blocks as forward's
            g, dkids = routing_calls.run_backward(self.algo, B, B.route_block(u_hat, sl),
                                             None if kids is None else kids[:, sl], trace, dv[sl],
                                             self.routing_param_values(), out=u_hat[:, sl])
            if dkids is not None:
                self._du_kids[:, sl] = dkids
            grads.append((sl.start or 0, g))

        B.split_batch(run, n, self.P * self.T * self.J * self.D)
        for _, g in sorted(grads, key=lambda part: part[0]):
            for k, d in g.items():
                self.grads[k] += self._per_slot(k, d)
        return u_hat

    @property
    def bias_j(self):
        """β_j (J, D) added to s_j, or None."""
        return self.params["bias"] if self.s_bias else None

    def route_shared(self, ut, W):
        """Dynamic routing of u (N, T, P, K) by W (T, J, D, K) shared over positions (shared_routing.py)."""
        return shared_routing.forward(self.B, ut, W, self.iters, self._chunk(ut.shape[0]), bias=self.bias_j)

    def _shared_W(self):
        return self.B.xp.reshape(self.params["W"], (self.T, self.J, self.D, self.K))

    def _chunk(self, n):
        return self.positions_per_chunk(self.chunk_bytes, n, self.T, self.J, np.dtype(self.B.dtype).itemsize)

    @staticmethod
    def positions_per_chunk(chunk_bytes, n, types, classes, itemsize):
        """Positions per chunk: the coupling coefficients of a chunk, (N, T, chunk, J), fill chunk_bytes."""
        return max(1, chunk_bytes // (n * types * classes * itemsize))

    def shared_coupling(self, r):
        """c of iteration r of the last shared forward, (N, T, P, J), made again from u and A^r."""
        ut, A = self.cache, self.trace[r][0]
        n, _, P, _ = ut.shape
        if A is None:
            return self.B.zeros((n, self.T, P, self.J)) + 1.0 / self.J
        return shared_routing.coupling(self.B, ut, A, 0, P)

    @property
    def coupling(self):
        """c_ij of each routing iteration of the last forward: list of (N, I, J) arrays."""
        xp = self.B.xp
        if self.share_spatial and self.routes_shared:
            return [xp.reshape(xp.permute_dims(self.shared_coupling(r), (0, 2, 1, 3)), (-1, self.P * self.T, self.J))
                    for r in range(len(self.trace))]
        return [self.coupling_layout(c) for c in self.coefficients()]

    def coupling_layout(self, c):
        """Coefficients as the routing holds them (N, J, I) -> as ``coupling`` gives them (N, I, J)."""
        return self.B.xp.permute_dims(self.B.asarray(c), (0, 2, 1))

    def last_coefficients(self):
        """The last iteration's coefficients (N, J, I): what "final" holds constant."""
        return self.coefficients()[-1]

    def routing_measures(self) -> dict:
        """The routing's own measures of the last forward (Routing.measures), {name: [per iteration]},
        each block's weighted by its samples; {} where the layer routed without its routing's trace."""
        if not hasattr(self, "algo") or self.trace is None or self.share_spatial and self.routes_shared:
            return {}
        sums, total = {}, 0
        for sl, trace in self.trace:
            n = len(range(*sl.indices(1 << 40)))
            routing_calls.add_measures(sums, routing_calls.run_measures(self.algo, self.B, trace), n)
            total += n
        return routing_calls.mean_measures(sums, total)

    def coefficients(self) -> list:
        """The routing's coefficients of each iteration of the last forward, the blocks joined: (N, J, I)."""
        per_block = [routing_calls.run_coupling(self.algo, trace, None, self.J) for _, trace in self.trace]
        return [self.B.xp.concat([block[r] for block in per_block]) for r in range(len(per_block[0]))]

    def backward(self, dv, input_grad=True):
        xp = self.B.xp
        if self.share_spatial and self.routes_shared:
            ut, self.cache = self.cache, None
            du, dW, dbias = shared_routing.backward(self.B, ut, self._shared_W(), self.trace, dv, self.routing_grad,
                                                    self._chunk(ut.shape[0]))
            self.grads["W"] += xp.reshape(dW, self.params["W"].shape)
            if self.s_bias:
                self.grads["bias"] += dbias
            return self._as_input(xp.permute_dims(du, (0, 2, 1, 3))) if input_grad else None
        ut, u_hat, kids = self.cache
        du_kids = self._du_kids = None if kids is None else self.B.empty(tuple(kids.shape))
        d_u_hat = self._route_blocks_backward(u_hat, dv)                         # dû (I, N, J, D)
        self.cache = self._du_kids = None
        del u_hat
        dh = xp.reshape(d_u_hat, (self.P, self.T, -1, self.J * self.D))          # (P, T, N, J*D)
        dW = self.B.matmul(xp.matrix_transpose(dh), ut)                           # (P, T, J*D, K)
        if self.params["W"].shape[0] == 1 < self.P:  # one W shared over the positions, û formed all the same
            dW = xp.sum(dW, axis=0, keepdims=True)
        self.grads["W"] += xp.reshape(dW, self.params["W"].shape)
        if not input_grad:
            return None
        Wm = xp.reshape(self.params["W"], (-1, self.T, self.J * self.D, self.K))
        du = self.B.matmul(dh, Wm)                                                # (P, T, N, K)
        if du_kids is not None:  # what the routing read of the child capsules themselves
            du = du + xp.reshape(du_kids, du.shape)
        return self._as_input(xp.permute_dims(du, (2, 0, 1, 3)))

    def _per_slot(self, k, g):
        """A routing parameter's gradient in the parameter's shape: per child (I, ...) summed over
        the positions where the parameter is shared (share_spatial)."""
        if k not in self.algo.per_child:
            return g
        xp = self.B.xp
        g = xp.reshape(g, (self.P, self.T, *g.shape[1:]))
        return xp.sum(g, axis=0, keepdims=True) if self.params[k].shape[0] == 1 < self.P else g

    def _as_input(self, du):
        """du (N, P, T, K) in the shape forward was given."""
        return du if len(self.in_shape) == 4 else self.B.xp.reshape(du, self.in_shape)


class AttentionCaps(ClassCaps):
    """Class capsules v_j from primary capsules u_i by self-attention routing (Efficient-CapsNet,
    attention_routing.py): ClassCaps with the routing "attention", whose learned bias β_ij on the
    coupling coefficients is shaped like W's leading axes: (P|1, T, J), one per (position, type)
    and class, or per type with ``share_spatial`` (which here only shares W and the bias: the
    attention scores need every û_j|i at once, so û is always formed).  Its output squash is
    Efficient-CapsNet's, v = (1 - e^-|s|) s / |s|; ``coupling`` gives c_ij + β_ij."""

    def __init__(self, backend, positions, types, in_dim, n_classes, out_dim, share_spatial=False, rng=None,
                 init_std=0.01):
        super().__init__(backend, positions, types, in_dim, n_classes, out_dim, iters=None, routing_grad="full",
                         share_spatial=share_spatial, rng=rng, init_std=init_std, routing="attention")


class CapsuleLogits(Layer):
    """A class logit from each class capsule by one linear map shared by every class (the head of
    Tsai et al. 2020, for capsules whose length is no probability): v (N, J, D) -> z (N, J),

        z_j = w . v_j + b;      dv_j = dz_j w,   dw = Σ_n Σ_j dz_j v_j,   db = Σ_n Σ_j dz_j

    followed by the head "logits" and cross-entropy."""

    def __init__(self, backend, dim, rng=None):
        super().__init__(backend)
        rng = rng if rng is not None else np.random.default_rng(0)
        bound = 1 / np.sqrt(dim)  # PyTorch's nn.Linear initialisation
        self._add_param("W", rng.uniform(-bound, bound, dim))
        self._add_param("b", rng.uniform(-bound, bound, 1))

    def forward(self, v):
        check_input("CapsuleLogits", v, f"class capsules v (N, J, {self.params['W'].shape[0]})",
                    self.params["W"].shape[0], ndim=3)
        self.cache = v
        return self.B.xp.sum(v * self.params["W"], axis=-1) + self.params["b"]

    def backward(self, dz, input_grad=True):
        xp = self.B.xp
        v, self.cache = self.cache, None
        self.grads["W"] += xp.sum(dz[..., None] * v, axis=(0, 1))
        self.grads["b"] += xp.reshape(xp.sum(dz), (1,))
        return dz[..., None] * self.params["W"] if input_grad else None


class CapsuleLength(Layer):
    """|v_j| = sqrt(sum_d v_jd^2), the class probability of a capsule;  dv = d|v| * v / |v|
    (0 where v = 0, the subgradient)."""

    def forward(self, v):
        xp = self.B.xp
        length = xp.sqrt(xp.sum(v * v, axis=-1))
        self.cache = (v, length)
        return length

    def backward(self, dlength, input_grad=True):
        xp = self.B.xp
        v, length = self.cache
        self.cache = None
        safe = xp.where(length > 0, length, 1)
        return xp.where(length[..., None] > 0, v * (dlength / safe)[..., None], 0)
