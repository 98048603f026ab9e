"""The backend's named operations for capsule layers: the predictions and products of dynamic
routing, the special functions of VB routing, matrix capsules' votes, EM routing's sums and the
slots of a convolutional capsule layer.  Each is written here as the math reads, with the Array
API's broadcasting (``self.xp``); a backend overrides one where another form is faster on it.
Backend (base.py) inherits them: a layer calls them as ``B.weighted_sum(...)``."""
from __future__ import annotations

import math


class CapsuleOps:
    """Mixed into Backend, whose ``xp``, ``matmul``, ``contiguous``, ``zeros``, ``empty``,
    ``dtype_name``, ``im2col`` and ``col2im`` these use."""

    # ---- ClassCaps' predictions û_j|i and routing's blocks of them (pycapsnet/core/capsules.py) -------------
    def predictions(self, ut, W_t):
        """û_j|i = W_ij u_i for every input capsule i = (p, t):  ut (P, T, N, K) and the transposed
        transforms W_t (P|1, T, K, J*D) -> (P, T, N, J*D), P*T small products (N x K) @ (K x J*D).
        C-ordered here (a backend may store it otherwise: NumPy, sample-major)."""
        return self.matmul(ut, W_t)

    def route_block(self, u_hat, sl):
        """The samples ``sl`` of û (I, N, J, D), for routing them as one block (B.split_batch): a
        C-ordered copy, which stays in cache through routing's passes over it (no copy where sl is
        the whole batch, as on a GPU)."""
        return self.contiguous(u_hat[:, sl])

    # ---- the three products of dynamic routing -------------------------------------------------
    # Shapes: û (I, N, J, D); c, b and their gradients (N, J, I); s, v and their gradients (N, J, D).
    # These defaults write the math as it reads, with broadcasting; a backend overrides one where
    # another form is faster on it (NumPy: BLAS on strided views, split over threads; PyTorch:
    # in-place multiply-adds; CuPy: cuBLAS while recording a graph).  This is where fused kernels go.
    def weighted_sum(self, c, u_hat):
        """s_j = sum_i c_ij û_j|i:  (N, J, I), (I, N, J, D) -> (N, J, D)."""
        xp = self.xp
        c_i_first = xp.permute_dims(c, (2, 0, 1))[..., None]           # (I, N, J, 1)
        return self.contiguous(xp.sum(u_hat * c_i_first, axis=0))

    def agreement(self, u_hat, v):
        """a_ij = û_j|i . v_j:  (I, N, J, D), (N, J, D) -> (N, J, I)."""
        xp = self.xp
        return self.contiguous(xp.permute_dims(xp.sum(u_hat * v[None], axis=-1), (1, 2, 0)))

    def outer_sum(self, coeffs, vecs, out=None):
        """dû_j|i = sum_q coeffs[q]_ij vecs[q]_j:  lists of (N, J, I) and (N, J, D) -> (I, N, J, D).
        The backward of routing is such a sum of outer products (routing_backward_factors).  With
        ``out`` (an (I, N, J, D) array or view) the sum is written there and returned; it may be û's
        own memory, which the factors do not read (ClassCaps writes dû over û, its last use)."""
        xp = self.xp
        du = None
        for c, v in zip(coeffs, vecs):
            term = xp.permute_dims(c, (2, 0, 1))[..., None] * v[None]      # (I, N, J, D)
            du = term if du is None else du + term
        return self._into(du, out)

    # ---- special functions ----------------------------------------------------------------------------
    # Variational Bayes routing's expectations under a Dirichlet and a Wishart need the digamma
    # function ψ = (ln Γ)' in its forward and the trigamma ψ' in its backward: SciPy, CuPy and
    # PyTorch each have them, under other names.
    def digamma(self, x):
        """ψ(x), elementwise."""
        raise NotImplementedError(f"the {self.name} backend has no digamma")

    def trigamma(self, x):
        """ψ'(x) for x > 0, elementwise, to float64's precision: ψ'(x) = ψ'(x + 1) + 1/x² lifts x
        to y = x + n >= 10 (n <= 10 terms 1/(x + k)², each where x + k is still below 10: no
        data-dependent loop), where the asymptotic series 1/y + 1/2y² + Σ_k B_2k / y^(2k+1) has
        converged.  Each term is written from x, not from the previous step's y: a step that read y
        three times would nest ten deep, and torch.compile, which inlines elementwise chains, would
        walk 3^10 paths.  (PyTorch's polygamma(1, x) is off by up to 5e-10 relatively, which VB
        routing's backward would carry.)"""
        xp = self.xp
        acc, y = xp.zeros_like(x), x
        for k in range(10):
            xk = x + k
            below = xk < 10
            acc = acc + xp.where(below, 1 / (xk * xk), 0.0)
            y = y + xp.where(below, 1.0, 0.0)
        z = 1 / (y * y)
        tail = z * (1 / 6 + z * (-1 / 30 + z * (1 / 42 + z * (-1 / 30 + z * (5 / 66 + z * (-691 / 2730 + z * 7 / 6))))))
        return acc + (1 + z / 2 * y + tail) / y

    def _into(self, result, out=None):
        """``result`` C-ordered (the layers reshape it), or copied into ``out`` when given."""
        if out is None:
            return self.contiguous(result)
        out[...] = result
        return out

    # ---- matrix capsules' votes (pycapsnet/core/matrix_capsules.py) ---------------------------------------
    def votes(self, M, W):
        """V_ij = M_i W_ij for every child slot i and parent type j: M (N, P, I, 16) and W (I, C, 4, 4)
        -> V (N, P, I, C, 16), and what ``votes_backward`` needs.  As I products (N*P*4, 4) @ (4, C*4):
        row (n, p, a) of M_i times W_i laid out [b, (c, d)], then the result laid out as V."""
        xp = self.xp
        n, p, i, _ = M.shape
        c = W.shape[1]
        Mi = xp.reshape(xp.permute_dims(xp.reshape(M, (n, p, i, 4, 4)), (2, 0, 1, 3, 4)), (i, n * p * 4, 4))
        Wi = xp.reshape(xp.permute_dims(W, (0, 2, 1, 3)), (i, 4, c * 4))
        Vi = self.matmul(Mi, Wi)                                                      # (I, N*P*4, C*4)
        V = xp.permute_dims(xp.reshape(Vi, (i, n, p, 4, c, 4)), (1, 2, 0, 4, 3, 5))   # (N, P, I, C, 4, 4)
        return xp.reshape(self.contiguous(V), (n, p, i, c, 16)), Mi

    def votes_backward(self, saved, W, dV):
        """From dL/dV (N, P, I, C, 16): (dW (I, C, 4, 4), dM (N, P, I, 16)), with ``saved`` from votes.
        dW_ij = sum_{n,p} M_i^T dV_ij  and  dM_i = sum_j dV_ij W_ij^T."""
        xp, Mi = self.xp, saved
        n, p, i, c, _ = dV.shape
        dVi = xp.reshape(xp.permute_dims(xp.reshape(dV, (n, p, i, c, 4, 4)), (2, 0, 1, 4, 3, 5)), (i, n * p * 4, c * 4))
        Wi = xp.reshape(xp.permute_dims(W, (0, 2, 1, 3)), (i, 4, c * 4))
        dW = xp.permute_dims(xp.reshape(self.matmul(xp.matrix_transpose(Mi), dVi), (i, 4, c, 4)), (0, 2, 1, 3))
        dMi = self.matmul(dVi, xp.matrix_transpose(Wi))                               # (I, N*P*4, 4)
        dM = xp.permute_dims(xp.reshape(dMi, (i, n, p, 4, 4)), (1, 2, 0, 3, 4))
        return dW, xp.reshape(self.contiguous(dM), (n, p, i, 16))

    # The same products without moving V, for a backend whose matmul writes through a strided view
    # (NumPy, PyTorch on the CPU, which supply _slot_rows and _matmul_into).  ``votes`` above makes V
    # in the products' layout and then copies it into (N, P, I, C, 16), and dV back: each a pass over
    # the biggest array of the step.  Here each slot i is one product (N*P, 16) @ (16, C*16) whose
    # result rows are the strided rows V[:, :, i] themselves: the 4x4 product M_i W_ij written as a
    # 16 x (C*16) matrix, W_big[(a, b), (c, a', d)] = [a = a'] W_icbd (four times the multiply-adds,
    # all inside BLAS).
    def slotwise_votes(self, M, W):
        xp = self.xp
        n, p, i, _ = M.shape
        c = W.shape[1]
        big = self.zeros((i, 4, 4, c, 4, 4), dtype=self.dtype_name(W))     # [i, a, b, c, a', d]
        for a in range(4):
            big[:, a, :, :, a, :] = xp.permute_dims(W, (0, 2, 1, 3))        # W_icbd at [i, a, b, c, a, d]
        big = xp.reshape(big, (i, 16, c * 16))
        M = self.contiguous(M)
        V = self.empty((n, p, i, c * 16), dtype=self.dtype_name(M))
        self._matmul_into(self._slot_rows(M), big, self._slot_rows(V))
        return xp.reshape(V, (n, p, i, c, 16)), (M, big)

    def slotwise_votes_backward(self, saved, W, dV):
        xp = self.xp
        M, big = saved
        n, p, i, c, _ = dV.shape
        dVs = self._slot_rows(xp.reshape(self.contiguous(dV), (n, p, i, c * 16)))
        dM = self.empty((n, p, i, 16), dtype=self.dtype_name(dV))
        self._matmul_into(dVs, xp.matrix_transpose(big), self._slot_rows(dM))      # dM_i = dV_i W_big_i^T
        dbig = xp.reshape(self.matmul(xp.matrix_transpose(self._slot_rows(M)), dVs), (i, 4, 4, c, 4, 4))
        dW = sum(dbig[:, a, :, :, a, :] for a in range(4))                          # [i, b, c, d], summed over a
        return self.contiguous(xp.permute_dims(dW, (0, 2, 1, 3))), dM

    # ---- the sums of EM routing (pycapsnet/core/em_routing.py) ---------------------------------------
    # Shapes: votes V and what is shaped like them (N, P, I, C, H); assignments (N, P, I, C); parent
    # poses μ and variances σ² (N, P, C, H).  Written as the math reads; NumPy overrides both with
    # batched BLAS products that sum without forming the product, PyTorch the sum over h alone
    # (_sum_last): both libraries sum slowly over the short last axis.
    def sum_children(self, w, x, y=None):
        """Σ_i w_ij x_ijh [y_ijh]: (N, P, I, C), (N, P, I, C, H) [, (N, P, I, C, H)] -> (N, P, C, H)."""
        prod = w[..., None] * x if y is None else w[..., None] * x * y
        return self.xp.sum(prod, axis=2)

    def sum_children_pair(self, w, v, x, wx=None):
        """(Σ_i w_ij x_ijh, Σ_i v_ij x_ijh): two weightings of the same x.  ``wx``, the product
        w x where the caller has formed it, is summed as it is here; the NumPy backend instead
        takes both sums in one pass over x, one batched product with both rows of weights."""
        return self.xp.sum(wx, axis=2) if wx is not None else self.sum_children(w, x), self.sum_children(v, x)

    def sum_entries(self, x, y, z=None):
        """Σ_h x_ijh y_ijh [z_jh]: x (N, P, I, C, H); y the same or a parent's (N, P, C, H), the same
        for every child; z (N, P, C, H) -> (N, P, I, C)."""
        prod = x * (y if y.ndim == x.ndim else y[:, :, None])
        if z is not None:
            prod *= z[:, :, None]
        return self._sum_last(prod)

    def _sum_last(self, x):
        """Σ over the last axis (sum_entries' h)."""
        return self.xp.sum(x, axis=-1)

    def moments_backward(self, d, w, dmu, dvar, dV):
        """The votes' side of the backward of the M-step's weighted moments, μ_jh = Σ_i w_ij V_ijh and
        σ²_jh = Σ_i w_ij d²_ijh with d = V - μ, given dμ and dσ² (N, P, C, H):
            dV_ijh += w_ij (2 dσ²_jh d_ijh + dμ_jh),   returns Σ_h d_ijh (dσ²_jh d_ijh + dμ_jh) (N, P, I, C).
        (The return is dL/dw_ij less Σ_h dμ_jh μ_jh, which em_backward adds in closed form.)  Overwrites d."""
        dw = self.sum_entries(d, d, dvar) + self.sum_entries(d, dmu)
        d *= (2 * dvar)[:, :, None]
        d += dmu[:, :, None]
        d *= w[..., None]
        dV += d
        return dw

    # ---- the slots of a convolutional capsule layer (pycapsnet/core/matrix_capsules.py, WindowGroup) -----
    # x (N, P, I): one value per slot of K x K windows (stride s) over an (N, H, W, T) grid of children,
    # P = OH*OW window positions, I = (kernel row, kernel column, type).  Both hand every slot a value
    # over all the slots that hold the same child.
    def window_sum(self, x, grid, k, stride):
        """Every slot gets the sum of x over its child's slots: col2im (the adjoint of the im2col gather
        that made the slots), then im2col."""
        image = self.col2im(self.xp.reshape(x, (-1, x.shape[-1])), grid, k, k, stride)
        return self.xp.reshape(self.im2col(image, k, k, stride), tuple(x.shape))

    def window_max(self, x, grid, k, stride):
        """Every slot gets the maximum of x over its child's slots: the scatter of window_sum with the
        maximum instead of the sum, one strided slice per kernel offset."""
        xp = self.xp
        n, h, w, t = grid
        oh, ow = (h - k) // stride + 1, (w - k) // stride + 1
        x6 = xp.reshape(x, (n, oh, ow, k, k, t))
        top = self.zeros(tuple(grid), dtype=self.dtype_name(x)) - math.inf  # pixels no window covers stay -inf
        for r in range(k):
            for c in range(k):
                rows, cols = slice(r, r + stride * oh, stride), slice(c, c + stride * ow, stride)
                top[:, rows, cols, :] = xp.maximum(top[:, rows, cols, :], x6[:, :, :, r, c, :])
        return xp.reshape(self.im2col(top, k, k, stride), tuple(x.shape))
