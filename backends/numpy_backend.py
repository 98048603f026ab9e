"""NumPy backend (CPU).  The CuPy backend subclasses it: CuPy mirrors NumPy's API, so the only
differences are the module and the host transfers -- what the CPU tests cover, the GPU confirms."""
from __future__ import annotations

import os

import numpy as np

from .base import Backend, keep_freed_memory, stacked_outer_form


class NumpyBackend(Backend):
    name = "numpy"

    def __init__(self, dtype: str = "float32", device: str = "cpu"):
        if device not in (None, "cpu"):
            from .base import BackendError

            raise BackendError(f"the numpy backend runs on the CPU only (got device={device!r}); "
                               "use backends.get('cupy') or backends.get('torch', device='cuda') for a GPU")
        super().__init__(dtype, "cpu")
        import array_api_compat.numpy as xp

        self.xp = xp
        self.lib = np  # the array module itself (numpy or cupy)
        # im2col/col2im copies are memory-bound and single-threaded in NumPy: split them over cores.
        self.threads = max(1, min(4, os.cpu_count() or 1))
        keep_freed_memory()  # reuse freed temporaries rather than fault in fresh pages (CuPy: host side)

    def _float(self, dtype=None):
        return self.lib.dtype(dtype or self.dtype)

    def asarray(self, a, dtype=None):
        if not isinstance(a, self.lib.ndarray):
            a = np.asarray(a)  # host data (a CuPy array stays on its device)
        if a.dtype.kind == "f" or dtype is not None:
            a = a.astype(dtype or self.dtype, copy=False)
        return self.lib.asarray(a)

    def to_numpy(self, x) -> np.ndarray:
        return np.asarray(x)

    def einsum(self, subscripts, *operands):
        if len(operands) == 2 and self.lib is np:
            out = _stacked_outer_sum(subscripts, *operands)
            if out is not None:
                return out
        # optimize=False: the contractions the layers use are batched (no BLAS path exists for them)
        # and NumPy's C loop does them in one pass without temporaries.
        return self.lib.einsum(subscripts, *operands, optimize=False)

    def contiguous(self, x):
        return self.lib.ascontiguousarray(x)

    def windows(self, x, kh, kw, stride):
        # sliding_window_view appends the window axes: (N, H-kh+1, W-kw+1, C, kh, kw); keep every
        # stride-th window, then move C last -> (N, OH, OW, kh, kw, C).  All views.
        v = self.lib.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(1, 2))
        return v[:, ::stride, ::stride].transpose(0, 1, 2, 4, 5, 3)


def _stacked_outer_sum(subscripts, a, b):
    """'qA,qB->O', a sum over q of outer products whose output ends with the indices only B has
    (the routing backward's 'qinj,qnjd->injd'), as one broadcast matmul: per output position a
    (1, Q) @ (Q, D) product, (I,N,J,1,Q) @ (N,J,Q,D).  NumPy's einsum loop takes twice as long
    on it.  None when the form does not apply."""
    form = stacked_outer_form(subscripts)
    if form is None:
        return None
    A, Bs, out = form
    only_b = [c for c in out if c not in A]                 # must end the output: matmul's columns
    if not only_b or out[len(out) - len(only_b):] != "".join(only_b):
        return None
    lead = out[:len(out) - len(only_b)]                     # batch indices: all of A, some of B
    # a -> (lead..., 1, Q);  b -> (lead with 1 where absent..., Q, prod(only_b))
    # (contiguous copies: the matmul loop is 2x slower on strided operands; they are small)
    a_v = np.ascontiguousarray(np.moveaxis(a, 0, -1).transpose([A.index(c) for c in lead] + [len(A)]))[..., None, :]
    b_perm = [Bs.index(c) + 1 for c in lead if c in Bs] + [0] + [Bs.index(c) + 1 for c in only_b]
    b_t = np.ascontiguousarray(b.transpose(b_perm))
    b_shape = [b.shape[Bs.index(c) + 1] if c in Bs else 1 for c in lead]
    d = [b.shape[Bs.index(c) + 1] for c in only_b]
    b_v = b_t.reshape(b_shape + [b.shape[0], int(np.prod(d))])
    res = a_v @ b_v                                          # (lead..., 1, prod(only_b))
    return res.reshape([a.shape[A.index(c) + 1] for c in lead] + d)
