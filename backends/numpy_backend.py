"""NumPy backend (CPU).  The CuPy backend subclasses it: CuPy mirrors NumPy's API, so the only
differences are the module and the host transfers -- what the CPU tests cover, the GPU confirms."""
from __future__ import annotations

import os

import numpy as np

from .base import Backend, keep_freed_memory, parse_einsum_pair


class NumpyBackend(Backend):
    name = "numpy"
    elementwise_block = 1 << 20  # 4 MB of float32: one block's temporaries stay in cache

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
            if self.lib is not np:
                self._check_host_transfer("a host-to-device copy")
            a = np.asarray(a)  # host data (a CuPy array stays on its device)
        if a.dtype.kind == "f" or dtype is not None:
            a = a.astype(dtype or self.dtype, copy=False)
        return self.lib.asarray(a)

    def to_numpy(self, x) -> np.ndarray:
        self._check_host_transfer("reading an array on the host")
        return np.asarray(x)

    def einsum(self, subscripts, *operands):
        if len(operands) == 2 and self.lib is np:
            out = _einsum_as_matmul(subscripts, *operands)
            if out is not None:
                return out
        # optimize=False: the contractions the layers use are batched (no BLAS path exists for them)
        # and NumPy's C loop does them in one pass without temporaries.
        # (its result follows the operands' memory order; the layers expect C order)
        return self.lib.ascontiguousarray(self.lib.einsum(subscripts, *operands, optimize=False))

    def contiguous(self, x):
        return self.lib.ascontiguousarray(x)

    def windows(self, x, kh, kw, stride):
        # sliding_window_view appends the window axes: (N, H-kh+1, W-kw+1, C, kh, kw); keep every
        # stride-th window, then move C last -> (N, OH, OW, kh, kw, C).  All views.
        v = self.lib.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(1, 2))
        return v[:, ::stride, ::stride].transpose(0, 1, 2, 4, 5, 3)


def _einsum_as_matmul(subscripts, a, b):
    """A two-operand einsum with one summed index, as one batched matrix product on views of the
    operands, written straight into an output laid out as the einsum's: the indices both operands
    and the output share are the batch, a's own output indices the rows, b's own the columns.  With
    several row (or column) indices the leading ones become broadcast batch axes; none becomes a
    size-1 axis.  NumPy hands each batch's product to BLAS when the matrix views have a unit stride,
    whatever the batch strides, so nothing is copied.

    Used where NumPy's einsum loop is slow: when the bigger operand's last index is not the summed
    one.  For routing's 'qnji,qnjd->injd' (a sum of outer products, q summed) that is, per (n, j), a
    (I, Q) @ (Q, D) product into the strided slice dû[:, n, j, :]: 6 ms where einsum takes ~60; for
    'nji,injd->njd' a (1, I) @ (I, D) product per (n, j): 8 ms against 11.  'injd,njd->nji' stays
    with einsum (the summed d is û's contiguous axis: 6 ms against matmul's 11).
    None when the form does not apply."""
    parsed = parse_einsum_pair(subscripts)
    if parsed is None:
        return None
    sa, sb, out = parsed
    summed = [c for c in sa if c in sb and c not in out]
    if len(summed) != 1 or set(sa) | set(sb) != set(out) | set(summed):
        return None
    if (sa if a.size >= b.size else sb)[-1] == summed[0]:
        return None  # the bigger operand is summed along its contiguous axis: einsum's loop is faster
    k = summed[0]
    batch = [c for c in out if c in sa and c in sb]
    rows = [c for c in out if c not in sb]
    cols = [c for c in out if c not in sa]

    def arrange(x, subs, axes):
        """View of x with the given axes (None: a new size-1 axis)."""
        v = x.transpose([subs.index(c) for c in axes if c is not None and c in subs])
        return np.expand_dims(v, tuple(p for p, c in enumerate(axes) if c is None or c not in subs))

    lead = batch + rows[:-1] + cols[:-1]
    r_in, c_in = rows[-1:] or [None], cols[-1:] or [None]           # the matrix axes (or size 1)
    a_m = arrange(a, sa, lead + r_in + [k])                          # (lead, rows, k)
    b_m = arrange(b, sb, lead + [k] + c_in)                          # (lead, k, cols)
    res = np.empty([dict(zip(sa + sb, a.shape + b.shape))[c] for c in out], dtype=np.result_type(a, b))
    np.matmul(a_m, b_m, out=arrange(res, out, lead + r_in + c_in))  # (lead, rows, cols), in place
    return res
