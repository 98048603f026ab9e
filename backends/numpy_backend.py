"""NumPy backend (CPU).  The CuPy backend subclasses it: CuPy mirrors NumPy's API, so the only
differences are the module and the host transfers -- what the CPU tests cover, the GPU confirms.

NumPy runs its elementwise loops and einsum on one core, and OpenBLAS runs a small product on one
core too; only large products use every core.  So on the CPU this backend splits the routing's
einsums and ClassCaps' batches of small products over the batch, on its threads (``_over_batch``)."""
from __future__ import annotations

import os
import sys
import warnings

import numpy as np

from .base import Backend, PerformanceWarning, keep_freed_memory, parse_einsum_pair


class NumpyBackend(Backend):
    name = "numpy"
    elementwise_block = 1 << 20  # 4 MB of float32: one block's temporaries stay in cache
    # einsum and matmul split their batch over the threads only from this size up (in elements of
    # the bigger operand): below it a thread's hand-off costs more than it saves
    parallel_min_elements = 1 << 18

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

    def quiet_float_errors(self):
        return np.errstate(over="ignore", invalid="ignore", divide="ignore")

    def einsum(self, subscripts, *operands):
        parsed = parse_einsum_pair(subscripts) if len(operands) == 2 and self.lib is np else None
        if parsed is None:
            # (its result follows the operands' memory order; the layers expect C order)
            return self.lib.ascontiguousarray(self.lib.einsum(subscripts, *operands, optimize=False))
        (sa, sb, out), (a, b) = parsed, operands
        size = dict(zip(sa + sb, a.shape + b.shape))
        res = np.empty([size[c] for c in out], dtype=np.result_type(a, b))  # C order
        # NumPy runs an einsum on one core.  A batch index -- one that both operands and the output
        # have, such as routing's n -- splits it into independent parts, one per thread.
        batch = [c for c in out if c in sa and c in sb]
        if not batch or max(a.size, b.size) < self.parallel_min_elements:
            _einsum_into(subscripts, parsed, a, b, res)
            return res
        k = batch[0]

        def part(sl):
            def cut(x, subs):
                return x[(slice(None),) * subs.index(k) + (sl,)]

            _einsum_into(subscripts, parsed, cut(a, sa), cut(b, sb), cut(res, out))

        _warn_if_blas_spins()
        self._over_batch(part, size[k])
        return res

    def matmul(self, a, b):
        if (self.lib is not np or self.threads <= 1 or a.ndim < 3 or a.ndim != b.ndim
                or a.shape[-2] * a.shape[-1] * b.shape[-1] >= _BLAS_THREADED_PRODUCT
                or max(a.size, b.size) < self.parallel_min_elements):
            return a @ b
        # A batch of small products: OpenBLAS runs each on one thread, so split the batch instead.
        lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        res = np.empty((*lead, a.shape[-2], b.shape[-1]), dtype=np.result_type(a, b))

        def part(sl):
            # an operand broadcast along the first batch axis (size 1 there) is used whole
            np.matmul(a if a.shape[0] == 1 else a[sl], b if b.shape[0] == 1 else b[sl], out=res[sl])

        _warn_if_blas_spins()
        self._over_batch(part, lead[0])
        return res

    def contiguous(self, x):
        return self.lib.ascontiguousarray(x)

    def windows(self, x, kh, kw, stride):
        # (N, H, W, C) -> (N, OH, OW, kh, kw, C), a view: window (oh, ow) starts at pixel
        # (stride*oh, stride*ow) and steps one pixel per kernel offset.  Built from strides by hand
        # rather than with sliding_window_view, which copies its window shape to the device on CuPy
        # (a host transfer that a recorded step cannot hold).
        n, h, w, c = x.shape
        sn, sh, sw, sc = x.strides
        oh, ow = (h - kh) // stride + 1, (w - kw) // stride + 1
        return self.lib.lib.stride_tricks.as_strided(
            x, (n, oh, ow, kh, kw, c), (sn, stride * sh, stride * sw, sh, sw, sc))


_blas_spins_checked = False


def _warn_if_blas_spins():
    """Once per process, at the first split over threads: warn if NumPy loaded OpenBLAS before
    ``import backends`` could set its thread timeout.  OpenBLAS's idle workers then spin ~0.1 s
    after every product, on the core that the split needs (backends/__init__.py; README, Results:
    "NumPy's threads")."""
    global _blas_spins_checked
    if _blas_spins_checked:
        return
    _blas_spins_checked = True
    from . import OPENBLAS_TIMEOUT_TOO_LATE

    if OPENBLAS_TIMEOUT_TOO_LATE and "openblas" in _blas_name():
        warnings.warn(
            "NumPy was imported before pycapsnet, so its OpenBLAS started with idle threads that spin "
            "for ~0.1 s after every product, on the core the numpy backend's own threads need: a train "
            "step takes 11-15% longer. Import pycapsnet (or backends) before numpy, or set "
            "OPENBLAS_THREAD_TIMEOUT=16 in the environment.", PerformanceWarning,
            stacklevel=_first_caller_outside_the_library())


# the packages a warning's line should not point into: it is about the caller's script
_LIBRARY_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), pkg, "")
                      for pkg in ("backends", "pycapsnet"))


def _first_caller_outside_the_library() -> int:
    """The ``stacklevel`` at which a warning raised by our caller points at the first frame outside
    backends/ and pycapsnet/ -- the user's line that started the work, not a layer's -- as Python
    3.12's ``skip_file_prefixes`` does."""
    frame, level = sys._getframe(1), 1  # level 1: the line that calls warnings.warn
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _blas_name() -> str:
    try:
        return np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"].lower()
    except Exception:  # an older NumPy, or a build that does not say: assume nothing
        return ""


# OpenBLAS runs a product of m*k*n multiply-adds on one thread below this size
# (SMP_THRESHOLD_MIN * GEMM_MULTITHREAD_THRESHOLD), and on all of them from it up
_BLAS_THREADED_PRODUCT = 65536 * 4


def _einsum_into(subscripts, parsed, a, b, out):
    """out[...] = einsum(subscripts, a, b), by a batched matmul where that form applies, else by
    NumPy's einsum loop (optimize=False: the contractions the layers use are batched, with no BLAS
    path of their own, and the loop does them in one pass without temporaries)."""
    if not _einsum_as_matmul(parsed, a, b, out):
        np.einsum(subscripts, a, b, out=out, optimize=False)


def _einsum_as_matmul(parsed, a, b, out):
    """A two-operand einsum with one summed index, as one batched matrix product on views of the
    operands, written straight into ``out`` (laid out as the einsum's output): the indices both
    operands and the output share are the batch, a's own output indices the rows, b's own the
    columns.  With several row (or column) indices the leading ones become broadcast batch axes;
    none becomes a size-1 axis.  NumPy hands each batch's product to BLAS when the matrix views have
    a unit stride, whatever the batch strides, so nothing is copied.

    Used where NumPy's einsum loop is slow: when the bigger operand's last index is not the summed
    one.  For routing's 'qnji,qnjd->injd' (a sum of outer products, q summed) that is, per (n, j), a
    (I, Q) @ (Q, D) product into the strided slice dû[:, n, j, :]; for 'nji,injd->njd' a
    (1, I) @ (I, D) product per (n, j).  'injd,njd->nji' stays with einsum (the summed d is û's
    contiguous axis, where the loop is faster).  Returns False, writing nothing, when the form does
    not apply."""
    sa, sb, out_subs = parsed
    summed = [c for c in sa if c in sb and c not in out_subs]
    if len(summed) != 1 or set(sa) | set(sb) != set(out_subs) | set(summed):
        return False
    if (sa if a.size >= b.size else sb)[-1] == summed[0]:
        return False  # the bigger operand is summed along its contiguous axis: einsum's loop is faster
    k = summed[0]
    batch = [c for c in out_subs if c in sa and c in sb]
    rows = [c for c in out_subs if c not in sb]
    cols = [c for c in out_subs if c not in sa]

    def arrange(x, subs, axes):
        """View of x with the given axes (None: a new size-1 axis)."""
        v = x.transpose([subs.index(c) for c in axes if c is not None and c in subs])
        return np.expand_dims(v, tuple(p for p, c in enumerate(axes) if c is None or c not in subs))

    lead = batch + rows[:-1] + cols[:-1]
    r_in, c_in = rows[-1:] or [None], cols[-1:] or [None]           # the matrix axes (or size 1)
    a_m = arrange(a, sa, lead + r_in + [k])                          # (lead, rows, k)
    b_m = arrange(b, sb, lead + [k] + c_in)                          # (lead, k, cols)
    np.matmul(a_m, b_m, out=arrange(out, out_subs, lead + r_in + c_in))  # (lead, rows, cols), in place
    return True
