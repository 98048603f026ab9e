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
    """'qA,qB->O', a sum over q of outer products (the routing backward's 'qinj,qnjd->injd'), as
    one batched matrix product written straight into the output: the indices A and B share are the
    batch, A's own are the rows, B's own the columns, q the inner dimension.  For the routing form
    that is, per (n, j), a (I, Q) @ (Q, D) product into the strided (I, D) slice dû[:, n, j, :]
    (BLAS takes the row stride as its leading dimension): 6 ms, where NumPy's einsum loop takes
    ~60.  With several row (or column) indices the leading ones become broadcast batch axes.
    None when the form does not apply."""
    form = stacked_outer_form(subscripts)
    if form is None:
        return None
    A, Bs, out = form
    batch = [c for c in out if c in A and c in Bs]
    rows = [c for c in out if c not in Bs]
    cols = [c for c in out if c not in A]
    # the output, viewed as (batch, rows[:-1], cols[:-1], rows[-1], cols[-1])
    order = batch + rows[:-1] + cols[:-1] + rows[-1:] + cols[-1:]
    size = {**{c: a.shape[A.index(c) + 1] for c in A}, **{c: b.shape[Bs.index(c) + 1] for c in Bs}}
    res = np.empty([size[c] for c in out], dtype=np.result_type(a, b))
    view = res.transpose([out.index(c) for c in order])
    # operands in matmul layout (contiguous copies of the stacked terms, which are small next to
    # the output), with size-1 axes where the other operand's own indices go
    a_m = np.ascontiguousarray(a.transpose([A.index(c) + 1 for c in batch + rows] + [0]))
    a_m = a_m.reshape([size[c] for c in batch + rows[:-1]] + [1] * (len(cols) - 1) + [size[rows[-1]], a.shape[0]])
    b_m = np.ascontiguousarray(b.transpose([Bs.index(c) + 1 for c in batch + cols[:-1]] + [0, Bs.index(cols[-1]) + 1]))
    b_m = b_m.reshape([size[c] for c in batch] + [1] * (len(rows) - 1) + [size[c] for c in cols[:-1]]
                      + [b.shape[0], size[cols[-1]]])
    np.matmul(a_m, b_m, out=view)
    return res
