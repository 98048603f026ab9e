"""NumPy backend (CPU).  The CuPy backend subclasses it: CuPy mirrors NumPy's API, so the only
differences are the module and the host transfers -- what the CPU tests cover, the GPU confirms.

NumPy runs its elementwise loops and einsum on one core, and OpenBLAS runs a small product on one
core too; only large products use every core.  So on the CPU this backend splits the routing
products and ClassCaps' batches of small products over the batch, on its threads (``_over_batch``).
(The CuPy backend overrides the routing products: those here write into NumPy arrays.)"""
from __future__ import annotations

import math
import threading

import numpy as np

from .base import array_api, Backend, BackendError
from .host import cpu_threads, keep_freed_memory, no_huge_page_advice


class NumpyBackend(Backend):
    name = "numpy"
    # 1 MB of float32: a block of each of Adam's four arrays and its temporaries, on each thread,
    # stay in cache between Adam's dozen passes (4 MB blocks did not)
    elementwise_block = 1 << 18
    # the routing products and matmul split their batch over the threads only from this size up (in elements of
    # the bigger operand): below it a thread's hand-off costs more than it saves
    parallel_min_elements = 1 << 18

    def __init__(self, dtype: str = "float32", device: str = "cpu"):
        if device not in (None, "cpu"):
            raise BackendError(f"the numpy backend runs on the CPU only (asked for device {device!r}); for a "
                               "GPU, use the cupy backend, or the torch backend on device cuda")
        super().__init__(dtype, "cpu")
        xp = array_api("numpy")

        self.xp = xp
        self.lib = np  # the array module itself (numpy or cupy)
        # im2col/col2im copies are memory-bound and single-threaded in NumPy: split them over cores.
        self.threads = cpu_threads()
        keep_freed_memory()  # reuse freed temporaries rather than fault in fresh pages (CuPy: host side)
        no_huge_page_advice()  # the heap's growth over the first steps, faulted in 4 KB pages (host.py)

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

    def _from_library(self, lib: str, a):
        if lib == "torch":
            a = a.detach()  # a tensor that requires grad: its values (pycapsnet computes its own gradients)
            if self.lib is np or a.device.type == "cpu":
                return a.cpu().numpy()
            return self.lib.from_dlpack(a.contiguous())  # CUDA tensor -> CuPy, on its GPU
        if lib == "cupy":  # to the NumPy backend: the device-to-host copy the user asked for
            return a.get()
        return a  # a NumPy array to CuPy: asarray copies it to the device

    def to_numpy(self, x) -> np.ndarray:
        self._check_host_transfer("reading an array on the host")
        return np.asarray(x)

    # SciPy's special functions are imported on first use: the module takes about a third of a
    # second to import, and only VB routing calls them
    def digamma(self, x):
        from scipy import special

        return special.digamma(x)

    def trigamma(self, x):
        from scipy import special

        return special.polygamma(1, x).astype(x.dtype, copy=False)  # (polygamma computes, and returns, float64)

    def adam(self, update, sizes, arrays, lr, betas, eps, step, scalars=None):
        """Adam in twelve passes over each cache-sized block and no temporaries, where optim.Adam's
        form takes thirteen and allocates seven: one scratch block per thread holds (1 - b1) g, then
        (1 - b2) g², then the step, and the bias correction moves out of the square root:
        lr_t m / (sqrt(v / c2) + eps) = (lr_t sqrt(c2)) m / (sqrt(v) + eps sqrt(c2)), with the device's
        scalars (host memory here) lr_t = lr / (1 - b1^t) and c2 = 1 - b2^t.  The same update to rounding
        (tests compare it with Backend's form and torch.optim.Adam).  CuPy (a subclass) and an apply()
        before any prepare() (step 0: it moves no weight) keep Backend's form."""
        if self.lib is not np or scalars is None or step < 1:
            return Backend.adam(self, update, sizes, arrays, lr, betas, eps, step)
        w, g, m, v = arrays
        b1, b2 = betas
        root_c2 = math.sqrt(float(scalars[1][0]))
        step_size, floor = float(scalars[0][0]) * root_c2, eps * root_c2
        scratch = threading.local()

        def block(k, sl):
            # views of one block of each flat array: the in-place passes write through to them
            wk, gk, mk, vk = (a[k].reshape(-1)[sl] for a in (w, g, m, v))
            t = getattr(scratch, "t", None)
            if t is None or t.size < gk.size:
                t = scratch.t = np.empty(max(self.elementwise_block or 0, gk.size), gk.dtype)
            t = t[:gk.size]
            np.multiply(gk, 1 - b1, out=t)
            mk *= b1
            mk += t                                   # m <- b1 m + (1 - b1) g
            np.multiply(gk, gk, out=t)
            t *= 1 - b2
            vk *= b2
            vk += t                                   # v <- b2 v + (1 - b2) g²
            np.sqrt(vk, out=t)
            t += floor
            np.divide(mk, t, out=t)
            t *= step_size
            wk -= t                                   # w <- w - lr_t m / (sqrt(v / c2) + eps)

        self.over_blocks(block, sizes)

    def quiet_float_errors(self):
        return np.errstate(over="ignore", invalid="ignore", divide="ignore")

    def _as_caller(self, fn):
        """NumPy's error state is per thread: the pool's threads take the caller's (quiet_float_errors
        around a step then quiets its parts too).  Set where it differs, and left there: a pool
        thread runs the backend's parts alone, each of which sets what it needs."""
        state = np.geterr()

        def run(part):
            if np.geterr() != state:
                np.seterr(**state)
            return fn(part)

        return run

    # The routing products (see Backend), CPU only.  NumPy runs a batch of small products on one core,
    # so each is split over the batch n on this backend's threads (where ClassCaps has not already
    # split the batch into blocks on them), and each part writes straight into its slice of the
    # result: s, the agreement and dû as batched BLAS products on strided views (nothing copied).
    def weighted_sum(self, c, u_hat):
        n, j, _ = c.shape
        s = np.empty((n, j, u_hat.shape[-1]), dtype=np.result_type(c, u_hat))

        def part(sl):  # per (n, j): c[n, j, :] (1, I) @ û[:, n, j, :] (I, D)
            np.matmul(c[sl, :, None, :], u_hat[:, sl].transpose(1, 2, 0, 3), out=s[sl, :, None, :])

        self._split_batch(part, n, u_hat.size)
        return s

    def agreement(self, u_hat, v):
        i, n, j, _ = u_hat.shape
        a = np.empty((n, j, i), dtype=np.result_type(u_hat, v))

        def part(sl):  # per (n, j): û[:, n, j, :] (I, D) @ v[n, j] (D, 1) into a[n, j, :]
            np.matmul(u_hat[:, sl].transpose(1, 2, 0, 3), v[sl, :, :, None], out=a[sl, :, :, None])

        self._split_batch(part, n, u_hat.size)
        return a

    def outer_sum(self, coeffs, vecs, out=None):
        C, V = np.stack(coeffs), np.stack(vecs)                 # (Q, N, J, I), (Q, N, J, D)
        _, n, j, i = C.shape
        du = np.empty((i, n, j, V.shape[-1]), dtype=np.result_type(C, V)) if out is None else out

        def part(sl):  # per (n, j): (I, Q) @ (Q, D) into the strided slice dû[:, n, j, :]
            np.matmul(C[:, sl].transpose(1, 2, 3, 0), V[:, sl].transpose(1, 2, 0, 3),
                      out=du[:, sl].transpose(1, 2, 0, 3))

        self._split_batch(part, n, max(C.size, V.size))
        return du

    votes = Backend.slotwise_votes  # see Backend
    votes_backward = Backend.slotwise_votes_backward

    def _slot_rows(self, x):
        n, p, i, k = x.shape
        if not x.flags["C_CONTIGUOUS"]:
            raise ValueError("votes' operands must be C-contiguous")  # a copy would take the written results
        return self.lib.lib.stride_tricks.as_strided(x, (i, n * p, k), (x.strides[2], x.strides[1], x.strides[3]))

    def _matmul_into(self, a, b, out):
        self.lib.matmul(a, b, out=out)

    # The sums of EM routing (see Backend) as batched BLAS products on strided views: one (1, I) @ (I, H)
    # or (I, H) @ (H, 1) per parent, rather than writing the broadcast product and then summing it
    # (NumPy's sum over the short last axis, H = 16, is slow).  EM routing already runs on blocks of
    # the batch spread over the threads (sample_block), so these do not split again.
    sample_block = 1 << 20  # elements of the votes per part: the part's temporaries stay in cache

    def sum_children(self, w, x, y=None):
        if y is not None:
            x = x * y
        lib = self.lib
        return lib.matmul(lib.swapaxes(w, 2, 3)[..., None, :], lib.swapaxes(x, 2, 3))[..., 0, :]

    def sum_children_pair(self, w, v, x, wx=None):
        lib = self.lib
        wv = lib.stack([lib.swapaxes(w, 2, 3), lib.swapaxes(v, 2, 3)], axis=-2)    # (N, P, C, 2, I)
        both = lib.matmul(wv, lib.swapaxes(x, 2, 3))                              # (N, P, C, 2, H)
        return both[..., 0, :], both[..., 1, :]

    def sum_entries(self, x, y, z=None):
        lib = self.lib
        if y.ndim == x.ndim:
            x, y = x * y, z                        # then sum over h with z, or with ones
        elif z is not None:
            x = x * z[:, :, None]
        if y is None:
            return x @ lib.ones(x.shape[-1], dtype=x.dtype)
        return lib.swapaxes(lib.matmul(lib.swapaxes(x, 2, 3), y[..., None])[..., 0], 2, 3)

    def over_blocks(self, fn, sizes):
        """Backend.over_blocks on the threads: NumPy's elementwise passes run on one core each.  Each
        thread takes every threads-th block, as one task: a task per block would hand the GIL back and
        forth between the threads between the blocks' short passes."""
        blocks = self._element_blocks(sizes)
        parts = [blocks[k::self.threads] for k in range(min(self.threads, len(blocks)))]
        self._run_parts(lambda part: [fn(*block) for block in part], parts)

    def over_host_threads(self, fn, n):
        self._over_batch(fn, n)  # see Backend; the CuPy backend has one thread, so one call

    def _split_batch(self, part, n, elements):
        """part(slice) over the batch, on the threads when the work (``elements`` of the biggest
        operand) is large enough to pay for the hand-off."""
        if elements < self.parallel_min_elements:
            part(slice(None))
            return
        self._over_batch(part, n)

    def matmul(self, a, b, out=None):
        """``a @ b``, into ``out`` (any strides) where given."""
        if (self.lib is not np or self.threads <= 1 or a.ndim < 3 or a.ndim != b.ndim
                or a.shape[-2] * a.shape[-1] * b.shape[-1] >= _BLAS_THREADED_PRODUCT
                or max(a.size, b.size) < self.parallel_min_elements):
            return a @ b if out is None else self.lib.matmul(a, b, out=out)
        # A batch of small products: OpenBLAS runs each on one thread, so split the batch instead.
        lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        res = np.empty((*lead, a.shape[-2], b.shape[-1]), dtype=np.result_type(a, b)) if out is None else out

        def part(sl):
            # an operand broadcast along the first batch axis (size 1 there) is used whole
            np.matmul(a if a.shape[0] == 1 else a[sl], b if b.shape[0] == 1 else b[sl], out=res[sl])

        self._over_batch(part, lead[0])
        return res

    # ClassCaps' û stored sample-major: (N, I, J, D) in memory, handed on as its permuted view
    # (I, N, J, D).  The products write into it through strided views, and every block of samples
    # that routing runs on (split_batch) is then one contiguous piece of memory that routing reads where
    # it lies: no copy of each block in forward, and again in backward.
    def predictions(self, ut, W_t):
        if self.lib is not np:
            return super().predictions(ut, W_t)
        p, t, n, _ = ut.shape
        u_hat = np.empty((n, p, t, W_t.shape[-1]), dtype=np.result_type(ut, W_t))
        self.matmul(ut, W_t, out=u_hat.transpose(1, 2, 0, 3))
        return u_hat.transpose(1, 2, 0, 3)                                   # (P, T, N, J*D), a view

    def route_block(self, u_hat, sl):
        if self.lib is not np:
            return super().route_block(u_hat, sl)
        return u_hat[:, sl]  # sample-major (predictions): already one contiguous piece

    # A memory-bound pass (a copy, ReLU) from this size up (elements) is split over the threads: NumPy
    # runs it on one core, and one core does not use all of the memory bandwidth.
    parallel_pass_elements = 1 << 22

    def _over_rows(self, fn, x):
        """A new array like x, written by fn(slice, out) over slices of x's first axis on the threads,
        or None where x is too small for that to pay (the caller then makes it at once)."""
        if self.lib is not np or x.ndim == 0 or x.size < self.parallel_pass_elements:
            return None
        out = np.empty(x.shape, dtype=x.dtype)
        self._over_batch(lambda sl: fn(sl, out), x.shape[0])
        return out

    def contiguous(self, x):
        if self.lib is np and x.flags["C_CONTIGUOUS"]:
            return x
        out = self._over_rows(lambda sl, out: out.__setitem__(sl, x[sl]), x)
        return self.lib.ascontiguousarray(x) if out is None else out

    def relu(self, x):
        y = self._over_rows(lambda sl, y: np.maximum(x[sl], 0, out=y[sl]), x)
        return super().relu(x) if y is None else y

    def relu_backward(self, dy, y):
        dx = self._over_rows(lambda sl, dx: np.multiply(dy[sl], y[sl] > 0, out=dx[sl]), dy)
        return super().relu_backward(dy, y) if dx is None else dx

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


def _blas_name() -> str:
    try:
        return np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"].lower()
    except Exception:  # an older NumPy, or a build that does not say: assume nothing
        return ""


# OpenBLAS runs a product of m*k*n multiply-adds on one thread below this size
# (SMP_THRESHOLD_MIN * GEMM_MULTITHREAD_THRESHOLD), and on all of them from it up
_BLAS_THREADED_PRODUCT = 65536 * 4
