"""The torch backend's forms of the capsule layers' named operations (capsule_ops.py has each one's
plain form): on the CPU, batched products on views of û (or NumPy's forms on the tensors' memory,
where NumPy's BLAS is the faster), in-place multiply-adds, gathers by index; a GPU mostly keeps the
plain forms, which its recorded step launches at once."""
from __future__ import annotations

import math

import numpy as np


class TorchCapsuleOps:
    """Mixed into TorchBackend ahead of Backend, whose ``torch``, ``_device``, ``_numpy``,
    ``_tracing`` and ``_window_indices`` these use; ``super()`` reaches Backend's plain forms."""

    # weighted_sum and agreement.  On the CPU, batched products on views of û, one per (n, j):
    # (1, I) @ (I, D) and (1, D) @ (D, I); Backend's forms write the broadcast product, then sum it
    # (over a short last axis for the agreement, slow in PyTorch).  GPUs keep Backend's forms, which
    # read û in place, where torch.einsum maps them to bmm after copying û into a batch-major layout.
    def weighted_sum(self, c, u_hat):
        if self._device.type != "cpu":
            return super().weighted_sum(c, u_hat)
        if self._numpy is not None:  # NumPy's batched products on views, split over its threads
            return self.torch.from_numpy(self._numpy.weighted_sum(c.numpy(), u_hat.numpy()))
        i, n, j, d = u_hat.shape
        return self.torch.bmm(c.reshape(n * j, 1, i), _per_parent(u_hat, (1, 0, 2))).reshape(n, j, d)

    def agreement(self, u_hat, v):
        if self._device.type != "cpu":
            return super().agreement(u_hat, v)
        if self._numpy is not None:
            return self.torch.from_numpy(self._numpy.agreement(u_hat.numpy(), v.numpy()))
        i, n, j, d = u_hat.shape
        return self.torch.bmm(v.reshape(n * j, 1, d), _per_parent(u_hat, (1, 2, 0))).reshape(n, j, i)

    def outer_sum(self, coeffs, vecs, out=None):
        """Backend.outer_sum accumulated in place, one multiply-add (addcmul_) per term, into a
        C-ordered result (a product of permuted views would follow their memory order instead) or
        into ``out``.  With NumPy's BLAS (``_numpy``), NumPy's form: one batched product per (n, j)."""
        if self._numpy is not None:
            du = self._numpy.outer_sum([c.numpy() for c in coeffs], [v.numpy() for v in vecs],
                                       out=None if out is None else out.numpy())
            return self.torch.from_numpy(du) if out is None else out

        def term(c, v):  # c_ij (N, J, I) and v_j (N, J, D) as broadcastable (I, N, J, 1), (1, N, J, D)
            return c.permute(2, 0, 1)[..., None], v[None]

        n, j, i = coeffs[0].shape
        du = coeffs[0].new_empty((i, n, j, vecs[0].shape[-1])) if out is None else out
        if self._tracing():  # Inductor writes no out= into a strided view: the product, then a copy
            du.copy_(self.torch.mul(*term(coeffs[0], vecs[0])))
        else:
            self.torch.mul(*term(coeffs[0], vecs[0]), out=du)
        for c, v in zip(coeffs[1:], vecs[1:]):
            du.addcmul_(*term(c, v))
        return du

    def _sum_last(self, x):
        """sum_entries' sum over h as a product with a vector of ones: PyTorch's CPU sum over a short
        last axis is slower.  (Backend's sum_children, a sum over a middle axis, is PyTorch's best
        form of that one.)"""
        return x @ self.torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)

    def moments_backward(self, d, w, dmu, dvar, dV):
        """Backend.moments_backward in five passes over d where it takes nine, with g = dσ² d + dμ:
        g as one multiply-add, Σ_h d g, then dV += w (2g - dμ) as another."""
        torch = self.torch
        dmu, dvar = dmu[:, :, None], dvar[:, :, None]
        g = torch.addcmul(dmu, d, dvar)
        dw = self._sum_last(d.mul_(g))
        torch.add(-dmu, g, alpha=2, out=g)
        dV.addcmul_(g, w[..., None])
        return dw

    # window_sum and window_max on the CPU: each child's slots gathered by index, three ops where
    # Backend's strided forms take one per kernel offset (dozens of small ops per routing iteration).
    # A GPU keeps Backend's forms: its index_add_ adds with atomics, in no fixed order, and its
    # recorded step launches the small ops at once.
    def _window_index(self, grid, k, stride):
        """For every slot (p, i) of one image, the flat index (row, column, type) of its child."""
        key = (tuple(grid[1:]), k, stride)
        if key not in self._window_indices:
            _, h, w, t = grid
            pixels = np.arange(h * w * t, dtype=np.int64).reshape(1, h, w, t)
            win = np.lib.stride_tricks.sliding_window_view(pixels, (k, k), axis=(1, 2))[:, ::stride, ::stride]
            slots = np.ascontiguousarray(win.transpose(0, 1, 2, 4, 5, 3)).reshape(-1)  # (oh, ow, k, k, t)
            self._window_indices[key] = self.torch.as_tensor(slots, device=self._device)
        return self._window_indices[key]

    def window_sum(self, x, grid, k, stride):
        if self._device.type != "cpu":
            return super().window_sum(x, grid, k, stride)
        index = self._window_index(grid, k, stride)
        flat = x.reshape(x.shape[0], -1)
        per_child = flat.new_zeros((x.shape[0], math.prod(grid[1:]))).index_add_(1, index, flat)
        return per_child.index_select(1, index).reshape(x.shape)

    def window_max(self, x, grid, k, stride):
        if self._device.type != "cpu":
            return super().window_max(x, grid, k, stride)
        index = self._window_index(grid, k, stride)
        flat = x.reshape(x.shape[0], -1)
        per_child = flat.new_full((x.shape[0], math.prod(grid[1:])), -math.inf)
        per_child.scatter_reduce_(1, index.expand(x.shape[0], -1), flat, "amax")
        return per_child.index_select(1, index).reshape(x.shape)

    def votes(self, M, W):
        """Backend.slotwise_votes on the CPU (a GPU records its step as a graph: there, Backend.votes)."""
        return (self.slotwise_votes if self._device.type == "cpu" else super().votes)(M, W)

    def votes_backward(self, saved, W, dV):
        return (self.slotwise_votes_backward if self._device.type == "cpu" else super().votes_backward)(saved, W, dV)

    def _slot_rows(self, x):
        n, p, i, k = x.shape
        if not x.is_contiguous():
            raise ValueError("votes' operands must be contiguous")  # a copy would take the written results
        return x.as_strided((i, n * p, k), (x.stride(2), x.stride(1), x.stride(3)))

    def _matmul_into(self, a, b, out):
        self.torch.matmul(a, b, out=out)


    def digamma(self, x):
        return self.torch.special.digamma(x)

    def trigamma(self, x):
        """On the CPU, SciPy's ψ' on the tensor's memory (the NumPy backend's, to float64's precision):
        Backend's series is some forty elementwise ops, each its own pass in eager PyTorch.  Traced
        steps, GPUs and tensors that require grad keep the series (PyTorch's ops only)."""
        if self._device.type != "cpu" or self._tracing() or x.requires_grad:
            return super().trigamma(x)
        from scipy import special

        a = x.numpy()
        return self.torch.from_numpy(special.polygamma(1, a).astype(a.dtype, copy=False))


def _per_parent(u_hat, order):
    """û (I, N, J, D) as one matrix per (n, j), a view: (N*J, I, D) with order (1, 0, 2), or
    transposed, (N*J, D, I), with (1, 2, 0)."""
    i, n, j, d = u_hat.shape
    return u_hat.reshape(i, n * j, d).permute(*order)
