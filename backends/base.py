"""The abstract array backend that every pycapsnet layer is written against.

The common part -- elementwise math, reductions, reshapes, matmul -- is the Python Array API
standard, reached through ``array-api-compat`` as ``backend.xp`` (so ``xp.sum(x, axis=1,
keepdims=True)`` means the same on NumPy, CuPy and PyTorch).  This class adds only what the
standard lacks and the layers need:

* moving arrays between the host (NumPy) and the backend, in the backend's float dtype;
* ``contiguous`` and ``matmul`` (``a @ b``, which a CPU backend may split over its threads when the
  batch is many small products);
* the named operations of the capsule layers (``capsule_ops.py``: dynamic routing's three products
  ``weighted_sum``, ``agreement`` and ``outer_sum``, matrix capsules' votes, EM routing's sums, VB
  routing's digamma and trigamma) and the convolution primitives (``conv_ops.py``: ``im2col``, its
  adjoint ``col2im``), each written as plain broadcasting and overridden where a backend has a
  faster form;
* ``synchronize`` for timing and ``memory`` for the memory in use;
* ``capture``: record a function's device work once and replay it (a CUDA graph on torch:cuda).

A subclass supplies the namespace, the host transfers and a strided window *view*; everything
else is shared.  Subclasses import their library lazily, in ``__init__``.
"""
from __future__ import annotations

import abc
import contextlib
import importlib
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .capsule_ops import CapsuleOps
from .conv_ops import ConvOps
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


def array_api(library: str):
    """array_api_compat's namespace for ``library`` (numpy, torch, cupy); BackendError saying how to
    install array-api-compat where it is missing (a clone run without ``pip install -e .``)."""
    try:
        return importlib.import_module(f"array_api_compat.{library}")
    except ModuleNotFoundError as e:
        if e.name not in ("array_api_compat", f"array_api_compat.{library}"):
            raise
        raise BackendError("pycapsnet's backends need the package array-api-compat, which is not installed: "
                           "pip install -e . in this repository (or pip install array-api-compat)") from None


class Backend(CapsuleOps, ConvOps, abc.ABC):
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
