"""The abstract array backend that every pycapsnet layer is written against.

The common part -- elementwise math, reductions, reshapes, matmul -- is the Python Array API
standard, reached through ``array-api-compat`` as ``backend.xp`` (so ``xp.sum(x, axis=1,
keepdims=True)`` means the same on NumPy, CuPy and PyTorch).  This class adds only what the
standard lacks and the layers need:

* moving arrays between the host (NumPy) and the backend, in the backend's float dtype;
* ``contiguous`` and ``matmul`` (``a @ b``, which a CPU backend may split over its threads when the
  batch is many small products);
* the three products of dynamic routing, by name: ``weighted_sum`` (s_j = sum_i c_ij û_j|i),
  ``agreement`` (û_j|i . v_j) and ``outer_sum`` (the backward's sum of outer products), each
  written here as plain broadcasting and overridden where a backend has a faster form;
* the two primitives of a strided 2-D convolution on channels-last images: ``im2col`` (gather every
  kernel window into a row of a matrix) and ``col2im`` (its adjoint: scatter-add rows back);
* ``synchronize`` for timing and ``memory`` for the memory in use;
* ``capture``: record a function's device work once and replay it (a CUDA graph on torch:cuda).

A subclass supplies the namespace, the host transfers and a strided window *view*; everything
else is shared.  Subclasses import their library lazily, in ``__init__``.
"""
from __future__ import annotations

import abc
import contextlib
import math
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .host import even_slices, mark_pool_thread, on_pool_thread, process_memory, reset_process_peak, sample_parts

FLOAT_DTYPES = ("float32", "float64")


def float_dtype_name(dtype) -> str | None:
    """The NumPy name of ``dtype`` in any of its spellings ('float32', 'f4', np.float32,
    np.dtype('float32'), torch.float32 -> 'float32'), or None if it names no dtype."""
    text = str(dtype)
    if text.startswith("torch."):  # torch dtypes print as torch.float32 (torch is not imported here)
        return text[len("torch."):]
    try:
        return np.dtype(dtype).name
    except TypeError:
        return None


def library_of(a) -> str | None:
    """'numpy', 'cupy' or 'torch' for an array of that library (by its type's module: nothing is
    imported), else None."""
    top = type(a).__module__.partition(".")[0]
    return top if top in ("numpy", "cupy", "torch") else None


class CompileWarning(UserWarning):
    """A step asked to be compiled runs uncompiled (the backend has no compiler, or it failed)."""


class BackendError(RuntimeError):
    """A backend cannot be created: unknown name, missing library, missing device, bad dtype."""


class Backend(abc.ABC):
    name: str = "abstract"
    # Elementwise passes over big arrays (the optimizers') work this many elements at a time, so
    # that one block's temporaries stay in a CPU cache; None: whole arrays (a GPU wants few launches).
    elementwise_block: int | None = None
    # True where ``capture`` records a graph that replays faster than running the function again.
    can_capture: bool = False

    def __init__(self, dtype: str = "float32", device: str = "cpu"):
        name = float_dtype_name(dtype)
        if name not in FLOAT_DTYPES:
            shown = f"{dtype!r}" + (f" ({name})" if name and name != str(dtype) else "")
            raise BackendError(f"unsupported dtype {shown}: pycapsnet computes in float32 or float64 only")
        self.dtype = name
        self.device = device
        self.threads = 1  # >1: memory-bound conv copies are split over the batch on a thread pool
        self._pool = None

    def __repr__(self):
        return f"<{type(self).__name__} {self.name}:{self.device} {self.dtype}>"

    def __reduce__(self):
        """Pickled (and deep-copied) as its name, device and dtype: it holds library modules and a
        thread pool, which do not pickle; what it computes depends on these three alone."""
        return (_rebuilt, (self.name, self.device, self.dtype))

    @property
    def label(self) -> str:
        """Short name used in tables, e.g. ``torch:cuda/float32``."""
        return f"{self.name}:{self.device}/{self.dtype}"

    # ---- host transfers ------------------------------------------------------------------
    library: str = "numpy"  # whose arrays this backend computes on

    def native(self, a):
        """``a`` as this backend's library holds it: an array of another library (a torch tensor
        given to the numpy backend, a CuPy array to torch) converted -- through DLPack, without a
        copy, where both sit on one GPU -- anything else as it is."""
        lib = library_of(a)
        return a if lib is None or lib == self.library else self._from_library(lib, a)

    def _from_library(self, lib: str, a):
        raise BackendError(f"the {self.name} backend cannot take a {lib} array; convert it to NumPy first")

    @abc.abstractmethod
    def asarray(self, a, dtype=None):
        """Host array (or scalar) -> backend array.  Floats become ``dtype or self.dtype``."""

    @abc.abstractmethod
    def to_numpy(self, x) -> np.ndarray:
        """Backend array -> NumPy array on the host (a copy when the data is on a device)."""

    def zeros(self, shape, dtype=None):
        return self.xp.zeros(tuple(shape), dtype=self._float(dtype), **self._device_kw())

    def arange(self, start, stop):
        """start, start + 1, ..., stop - 1 as floats, made on the device (no host copy: a captured
        step may make it)."""
        return self.xp.arange(start, stop, dtype=self._float(), **self._device_kw())

    def empty(self, shape, dtype=None):
        """Uninitialised: for buffers that are written in full before they are read."""
        return self.xp.empty(tuple(shape), dtype=self._float(dtype), **self._device_kw())

    def _device_kw(self):
        return {}

    @abc.abstractmethod
    def _float(self, dtype=None):
        """The library's float dtype object for ``dtype`` (default: the backend's)."""

    # ---- what the Array API standard lacks ------------------------------------------------
    @abc.abstractmethod
    def windows(self, x, kh: int, kw: int, stride: int):
        """Strided *view* of every kh x kw window of a channels-last batch.

        x: (N, H, W, C)  ->  (N, OH, OW, kh, kw, C), OH = (H - kh) // stride + 1.
        """

    @abc.abstractmethod
    def contiguous(self, x):
        """``x`` laid out C-contiguously (a copy only if it is a strided view), for operands that a
        BLAS call reads faster that way (PyTorch's batched matmul is much slower on a transposed view)."""

    def matmul(self, a, b):
        """``a @ b``.  The layers send every matrix product here, so that a backend may run it its
        own way: NumPy splits a batch of many small products (ClassCaps' (N x K) @ (K x J*D), one
        per input capsule) over threads, as its BLAS runs each on one core; CuPy calls cuBLAS itself
        while it records a CUDA graph, as CuPy's own matmul refuses to run then."""
        return a @ b

    def dtype_name(self, x) -> str:
        """The float dtype of backend array ``x`` as a name ('float32', 'float64'), for ``zeros``
        and ``empty`` buffers that must match an operand."""
        return str(x.dtype).replace("torch.", "")

    def is_floating(self, x) -> bool:
        """Whether ``x`` -- a host NumPy array or one of this backend's -- holds real floats."""
        if isinstance(x, np.ndarray):
            return x.dtype.kind == "f"
        return self.xp.isdtype(x.dtype, "real floating")

    # ---- ReLU (pycapsnet/core/layers.py) ----------------------------------------------------------------
    def relu(self, x):
        """y = max(x, 0).  clip with a scalar bound: maximum(x, 0) would first make the 0 an array
        (on a GPU, a host-to-device copy per call, which a captured step cannot replay)."""
        return self.xp.clip(x, min=0.0)

    def relu_backward(self, dy, y):
        """dx = dy [y > 0], from y = relu(x): a multiply by the 0/1 mask (faster than where() on NumPy)."""
        return dy * (y > 0)

    # ---- batch normalisation's passes over channels-last arrays (pycapsnet/core/batch_norm.py) ----
    def channel_affine(self, x, a, c):
        """x * a + c with a and c per channel (the last axis): one pass where the library fuses it."""
        y = x * a
        y += c
        return y

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

    def out_of_memory(self, exc: BaseException) -> bool:
        """Whether ``exc`` is this library's way of saying that an allocation did not fit (NumPy's
        and CuPy's errors are MemoryErrors)."""
        return isinstance(exc, MemoryError)

    def all_finite(self, x) -> bool:
        """Whether every entry of ``x`` is finite; a host NumPy array is checked where it is."""
        if isinstance(x, np.ndarray):
            return bool(np.isfinite(x).all())
        self._check_host_transfer("a check that reads the device")
        return bool(self.xp.all(self.xp.isfinite(x)))

    # ---- data parallelism (pycapsnet.training.distributed) ---------------------------------------------------
    # torch.distributed's process-group backend for this backend's arrays: gloo for host memory,
    # NCCL for CUDA devices (set by the GPU backends).
    collective_backend = "gloo"

    def as_torch(self, x):
        """A torch tensor sharing ``x``'s memory (no copy), for torch.distributed's collectives."""
        import torch

        return torch.from_numpy(x)

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on the CPU); call before reading a clock."""

    def quiet_float_errors(self):
        """A context in which overflow and invalid values (inf, NaN) pass without warnings, for a
        caller that checks the result itself: the trainer tests every step's loss and stops with
        one line that says what to do.  NumPy warns on them; CuPy and PyTorch never do."""
        return contextlib.nullcontext()

    def capture(self, fn):
        """Record ``fn``'s device work and return a callable that replays it: the kernels, their
        arguments and the addresses of every array they touch are fixed at capture, so ``fn`` must
        read its inputs from, and leave its results in, arrays that stay alive, and must not move
        data to or from the host (the host copy would be baked in, or is refused by CUDA).
        Running ``fn`` may mutate state (the warm-up runs do); the caller saves and restores it.

        Here (no graph support) the returned callable runs ``fn`` again each time, with host
        transfers refused, so that what a graph could not replay fails on the CPU too.  As a graph
        capture does, this runs ``fn`` twice first: once as is (constants that a layer builds on its
        first call come from the host), once with host transfers refused."""
        fn()

        def run():
            with self.host_transfers_refused():
                fn()

        run()
        return run

    compiles = False  # whether compile() fuses (a backend with a compiler)

    def compile(self, fn):
        """``fn`` (no arguments) as a callable that runs it compiled into fused kernels where this
        backend has a compiler (the torch backend: ``torch.compile``).  Here there is none: ``fn``
        itself, after a CompileWarning saying so."""
        warnings.warn(f"the {self.name} backend has no compiler: the step runs uncompiled (the torch "
                      "backend compiles it)", CompileWarning, stacklevel=2)
        return fn

    _host_transfers_refused = False

    @contextlib.contextmanager
    def host_transfers_refused(self):
        """Within: host transfers raise BackendError (what a recorded step must not do)."""
        self._host_transfers_refused = True
        try:
            yield
        finally:
            self._host_transfers_refused = False

    def may_read_back(self) -> bool:
        """Whether a value may be read back to the host now: not while a step is recorded."""
        return not self._host_transfers_refused

    def _check_host_transfer(self, what: str) -> None:
        if self._host_transfers_refused:
            raise BackendError(f"{what} inside a captured step: a graph replays device work only; "
                               "move it before or after the step")

    def memory(self) -> dict:
        """Bytes in use: {'current': ..., 'peak': ..., 'kind': what is measured}."""
        return process_memory()

    def reset_peak_memory(self) -> None:
        reset_process_peak()

    # ---- convolution primitives (shared) -----------------------------------------------------
    # True where the library has its own convolution (``conv2d``, ``conv2d_backward``): Conv2d then
    # calls it instead of its im2col products.  False here: the layer's im2col form is the default.
    direct_conv: bool = False

    def conv2d(self, x, W, b, stride: int, padding: int):
        """y = conv(x, W) + b on channels-last images, by the library's own convolution (only where
        ``direct_conv``).  x (N, H, W, C_in), W (kh, kw, C_in, C_out), b (C_out,) -> (N, OH, OW, C_out)."""
        raise NotImplementedError(f"the {self.name} backend has no direct convolution (direct_conv is False)")

    def conv2d_backward(self, dy, x, W, stride: int, padding: int, input_grad: bool = True):
        """(dx or None, dW) of ``conv2d`` for dy (N, OH, OW, C_out): dW = sum over windows of x^T dy
        in W's layout, dx = the transposed convolution of dy -- the library's own kernels."""
        raise NotImplementedError(f"the {self.name} backend has no direct convolution (direct_conv is False)")

    def pad_hw(self, x, padding: int):
        """Zero-pad the two spatial axes of (N, H, W, C) by ``padding`` on each side."""
        if padding == 0:
            return x
        n, h, w, c = x.shape
        out = self.zeros((n, h + 2 * padding, w + 2 * padding, c), dtype=self.dtype_name(x))
        out[:, padding:padding + h, padding:padding + w, :] = x
        return out

    def im2col(self, x, kh: int, kw: int, stride: int, padding: int = 0):
        """(N, H, W, C) -> cols (N*OH*OW, kh*kw*C): row (n, oh, ow) holds window (oh, ow) of image n,
        flattened in (kh, kw, C) order, so that ``cols @ W.reshape(kh*kw*C, C_out)`` is the convolution."""
        win = self.windows(self.pad_hw(x, padding), kh, kw, stride)  # a view, no copy yet
        n, oh, ow = win.shape[:3]
        cols = self.xp.empty(tuple(win.shape), dtype=self._float(self.dtype_name(x)), **self._device_kw())

        def gather(sl):
            cols[sl] = win[sl]

        self._over_batch(gather, n)
        return self.xp.reshape(cols, (n * oh * ow, kh * kw * x.shape[3]))

    def col2im(self, cols, x_shape, kh: int, kw: int, stride: int, padding: int = 0):
        """Adjoint of ``im2col``: add every row of ``cols`` back onto the pixels its window covers.

        cols: (N*OH*OW, kh*kw*C) -> (N, H, W, C).  One strided add per kernel offset (i, j): the
        values that offset saw at output positions (oh, ow) return to pixels (i + s*oh, j + s*ow)."""
        n, h, w, c = x_shape
        hp, wp = h + 2 * padding, w + 2 * padding
        oh, ow = (hp - kh) // stride + 1, (wp - kw) // stride + 1
        c6 = self.xp.reshape(cols, (n, oh, ow, kh, kw, c))
        dx = self.zeros((n, hp, wp, c), dtype=self.dtype_name(cols))

        def scatter(sl):
            d, src = dx[sl], c6[sl]
            for i in range(kh):
                for j in range(kw):
                    d[:, i:i + stride * oh:stride, j:j + stride * ow:stride, :] += src[:, :, :, i, j, :]

        self._over_batch(scatter, n)
        return dx[:, padding:padding + h, padding:padding + w, :] if padding else dx

    # ---- helpers -----------------------------------------------------------------------------
    # Per-sample work of many elementwise passes (EM routing) runs on parts of the batch of about
    # this many elements each, so that a part's temporaries stay in the CPU's caches; None: whole.
    sample_block: int | None = None

    def split_batch(self, fn, n: int, sample_size: int = 1) -> None:
        """Call fn(slice) over parts of a batch of n samples of ``sample_size`` elements each, for
        per-sample work made of many elementwise passes (EM routing): blocks of about
        ``sample_block`` elements, spread over this backend's host threads (NumPy runs each pass on
        one core).  One call with slice(None) where ``sample_block`` is None (a GPU wants few, large
        launches).  fn must not care in which order the parts run."""
        self._run_parts(fn, self._sample_blocks(n, sample_size))

    def adam(self, update, sizes: dict, arrays: tuple, lr: float, betas: tuple, eps: float, step: int,
             scalars: tuple = None) -> None:
        """One Adam step over every parameter: here optim.Adam's own ``update(key, block)`` over
        ``over_blocks``, which reads the step's scalars from the device (so a recorded step replays
        it with each step's).  A backend may instead run a fused kernel on ``arrays`` (the dicts w,
        g, m, v), from the host's lr, betas, eps and step count, or from ``scalars``: the device
        arrays (1,) holding lr / (1 - b1^t) and 1 - b2^t."""
        self.over_blocks(update, sizes)

    def over_blocks(self, fn, sizes: dict) -> None:
        """Call fn(key, slice) over the blocks of ``elementwise_block`` elements of flat arrays of
        ``sizes`` (key -> length; whole arrays where the block is None): the optimizers' elementwise
        passes, whose temporaries then stay in cache.  One block after another here; NumPy spreads
        them over its threads (each of its elementwise passes runs on one core)."""
        for key, sl in self._element_blocks(sizes):
            fn(key, sl)

    def over_host_threads(self, fn, n: int) -> None:
        """fn(slice) over parts of range(n), spread over this backend's host threads where its library
        runs a memory-bound pass on one core (NumPy); here one call, fn(slice(None)): PyTorch threads
        inside each op, and a GPU wants one launch.  For passes such as a transposing copy, whose
        parts write disjoint memory; fn must not care in which order its parts run."""
        fn(slice(None))

    def _element_blocks(self, sizes: dict) -> list:
        step = self.elementwise_block
        if not step:
            return [(key, slice(None)) for key in sizes]
        return [(key, slice(a, a + step)) for key, size in sizes.items() for a in range(0, size, step)]

    def _sample_blocks(self, n: int, sample_size: int) -> list:
        """Slices that split a batch of n into blocks of about ``sample_block`` elements, at least one
        per thread (when n allows)."""
        if self.sample_block is None:
            return [slice(None)]
        return even_slices(n, sample_parts(n, sample_size, self.sample_block, self.threads))

    def _over_batch(self, fn, n: int) -> None:
        """Call fn(slice) over slices that split a batch of n, on ``self.threads`` threads.  Used for
        work that NumPy runs on one core and that releases the GIL: the memory-bound gathers and
        scatters of im2col/col2im, and (NumPy backend) the routing products and batches of small products."""
        whole = self.threads <= 1 or n < 2 * self.threads or on_pool_thread()
        self._run_parts(fn, [slice(None)] if whole else even_slices(n, self.threads))

    def _run_parts(self, fn, slices) -> None:
        """fn(slice) for every slice, on this backend's thread pool when there are several."""
        # Work already on one of the pool's threads (split_batch's parts call im2col, matmul, ...) runs
        # where it is: the pool's threads are all busy with the parts, so waiting on them would deadlock.
        if self.threads <= 1 or len(slices) == 1 or on_pool_thread():
            for sl in slices:
                fn(sl)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, initializer=mark_pool_thread)
        list(self._pool.map(self._as_caller(fn), slices))

    def _as_caller(self, fn):
        """``fn`` to run on a pool thread as on the calling one: where a library keeps per-thread
        state the caller set (NumPy's floating-point error handling), the backend carries it over."""
        return fn


def _rebuilt(name, device, dtype):
    """The backend ``Backend.__reduce__`` describes."""
    from . import get

    return get(name, device=device, dtype=dtype)
