"""PyTorch backend (CPU or CUDA).  Plain tensors only: nothing here, or in the layers, asks for
autograd -- every gradient is computed by pycapsnet's hand-written backward."""
from __future__ import annotations

import os
import warnings

import numpy as np

from .base import array_api, Backend, BackendError, CompileWarning
from .host import cpu_threads, cpu_vendor, keep_freed_memory, no_huge_page_advice
from .numpy_backend import NumpyBackend, _blas_name
from .torch_capsule_ops import TorchCapsuleOps


def is_torch_device(name: str) -> bool:
    """'cpu', 'cuda' or 'cuda:N': the devices this backend (and the benchmark's autograd reference) run on."""
    return name in ("cpu", "cuda") or (name.startswith("cuda:") and name[5:].isdigit())


class TorchBackend(TorchCapsuleOps, Backend):
    name = "torch"

    def __init__(self, dtype: str = "float32", device: str = "cpu"):
        # PyTorch's THP_MEM_ALLOC_ENABLE=1 would advise 2 MB pages for its large CPU tensors; left at
        # its default, off.  Freed memory is reused here (keep_freed_memory), so a step fills no fresh
        # pages once the heap has reached its high water; until then each fresh 2 MB page would be
        # cleared whole at its first touch (on a virtual machine, the larger part of the first steps'
        # time), and the heap would grow further.
        try:
            import torch
        except ImportError as e:
            raise BackendError("the torch backend needs PyTorch, which is not installed: "
                               "pip install 'pycapsnet[torch]' (or pip install torch)") from e
        super().__init__(dtype, device or "cpu")
        dev = str(self.device)
        if not is_torch_device(dev):
            raise BackendError(f"unknown torch device {dev!r}: use 'cpu', 'cuda' or 'cuda:N'")
        if dev != "cpu" and not torch.cuda.is_available():
            raise BackendError(f"device {dev!r} asked for, but torch.cuda.is_available() is False "
                               "(no CUDA GPU or a CPU-only PyTorch build); run on the CPU: --device cpu on "
                               "the command line, device='cpu' in Python")
        xp = array_api("torch")

        self.torch = torch
        self._is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
        self.compiles = hasattr(torch, "compile") and self._is_compiling is not None
        self.xp = xp
        self._window_indices = {}
        self._device = torch.device(dev)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.device = str(self._device)
        if self._device.type == "cpu":
            # col2im's strided adds are memory-bound and run best split over the batch
            self.threads = cpu_threads()
            self.elementwise_block = 1 << 20  # as NumPy's: a block's temporaries stay in cache
            # routing's blocks of the batch (dynamic and EM): four times NumPy's.  PyTorch runs the
            # blocks one after another (split_batch), each op on all threads with a fixed cost per
            # call, so fewer, larger blocks pay (docs/performance.md)
            self.sample_block = 1 << 22
            keep_freed_memory()  # PyTorch's CPU allocator is glibc's malloc: same reasoning as NumPy
            no_huge_page_advice()  # its heap grows over the first steps: fresh pages cleared 4 KB at a time
            self.direct_conv = _direct_conv()
            if _numpy_blas_is_faster():
                self._host_blas = NumpyBackend(self.dtype)
                # routing's products are then NumPy's too, which run outside the GIL: its blocks go as
                # NumPy's do, in NumPy's size, spread over the threads (split_batch)
                self.sample_block = NumpyBackend.sample_block
        else:
            # A step is hundreds of small kernels: on a GPU, launching them costs more than running
            # them.  A CUDA graph launches them all at once (docs/performance.md, GPU).
            self.can_capture = True

    # Matrix products.  PyTorch's CPU wheels multiply through MKL, which on AMD CPUs runs the step's
    # skinny products (the Fourier transforms: inner dimension 25 or 100, hundreds of thousands of
    # columns) and its batches of small ones (ClassCaps' û = W u, routing's products) at half
    # OpenBLAS's speed or less (docs/performance.md).  There the CPU backend hands them, and the
    # three routing products, to NumPy: NumPy views the tensors' memory as it is (Tensor.numpy()
    # copies nothing) and writes into a new tensor (or the one given).
    _host_blas = None  # a NumpyBackend whose products run this backend's (None: PyTorch's own)

    @property
    def _numpy(self):
        """``_host_blas``, except while torch.compile traces a step (``compile``): a traced step is
        PyTorch's ops only, which the compiler can see and fuse."""
        return None if self._tracing() else self._host_blas

    def _tracing(self) -> bool:
        return self._is_compiling is not None and self._is_compiling()

    @property
    def tracks_writes(self) -> bool:
        """Whether every in-place write to a tensor goes through PyTorch, which counts it in the
        tensor's version (pycapsnet.torch learns from that what a backward writes over): not where
        NumPy writes products into the tensors' memory."""
        return self._numpy is None

    def matmul(self, a, b):
        if self._numpy is None or a.ndim < 2 or b.ndim < 2:
            return a @ b
        # NumPy's: torch.broadcast_shapes imports sympy on first use (hundreds of modules, tens of MB)
        lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        out = a.new_empty((*lead, a.shape[-2], b.shape[-1]))
        self._numpy.matmul(a.numpy(), b.numpy(), out=out.numpy())
        return out

    # With NumPy's products, ClassCaps' û is stored sample-major as in the NumPy backend (see
    # NumpyBackend.predictions): each block of samples that routing runs on is then one contiguous
    # piece, read in place, instead of a copy of the block in forward and again in backward.
    def predictions(self, ut, W_t):
        if self._numpy is None:
            return super().predictions(ut, W_t)
        return self.torch.from_numpy(self._numpy.predictions(ut.numpy(), W_t.numpy()))  # (P, T, N, J*D), a view

    def route_block(self, u_hat, sl):
        return super().route_block(u_hat, sl) if self._numpy is None else u_hat[:, sl]

    # Convolutions (Conv2d) on the CPU: PyTorch's own kernels (oneDNN's direct ones), forward and
    # both gradients (aten.convolution_backward: the kernels autograd would call, called here by
    # hand, so nothing requires grad).  Our (N, H, W, C) images are PyTorch's channels-last memory
    # format: permuted to (N, C, H, W) they are read in place, and the outputs come back in it.  On
    # CUDA the layer's im2col form stays until cuDNN's kernels are checked there (whether their
    # weight gradient is deterministic, and under CUDA graphs).
    def conv2d(self, x, W, b, stride, padding):
        y = self.torch.nn.functional.conv2d(x.permute(0, 3, 1, 2), _oihw(W), b, stride, padding)
        return y.permute(0, 2, 3, 1).contiguous()  # a view where y is channels-last, as it is here

    def conv2d_backward(self, dy, x, W, stride, padding, input_grad=True):
        dx, dW, _ = self.torch.ops.aten.convolution_backward(
            dy.permute(0, 3, 1, 2), x.permute(0, 3, 1, 2), _oihw(W), None, [stride, stride],
            [padding, padding], [1, 1], False, [0, 0], 1, [input_grad, True, False])
        dx = dx.permute(0, 2, 3, 1).contiguous() if input_grad else None
        return dx, dW.permute(2, 3, 1, 0)  # (C_out, C_in, kh, kw) -> W's (kh, kw, C_in, C_out), a view

    def channel_affine(self, x, a, c):
        return self.torch.addcmul(c, x, a)  # one pass, no temporary

    @property
    def collective_backend(self):
        return "nccl" if self._device.type == "cuda" else "gloo"

    def as_torch(self, x):
        return x

    def _float(self, dtype=None):
        return getattr(self.torch, dtype or self.dtype)

    def _device_kw(self):
        return {"device": self._device}

    library = "torch"

    def _from_library(self, lib: str, a):
        return self.torch.from_dlpack(a) if lib == "cupy" else a  # NumPy: as_tensor takes it

    def asarray(self, a, dtype=None):
        t = self.torch
        if isinstance(a, t.Tensor):
            x = a.to(self._device)
        else:
            self._check_host_transfer("a host-to-device copy")
            x = t.as_tensor(np.asarray(a), device=self._device)
        if x.is_floating_point() or dtype is not None:
            x = x.to(self._float(dtype))
        return x

    def to_numpy(self, x) -> np.ndarray:
        self._check_host_transfer("reading an array on the host")
        return x.detach().cpu().numpy()

    def capture(self, fn):
        """On CUDA: a CUDA graph of ``fn`` (torch.cuda.CUDAGraph), replayed with one launch.  ``fn``
        runs twice first on a side stream, as PyTorch asks (cuBLAS handles, lazily built constants,
        allocator state), the second time with host transfers refused; the graph's temporaries live
        in its own memory pool for as long as the graph does."""
        if self._device.type != "cuda":
            return super().capture(fn)
        torch = self.torch
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            fn()
            with self.host_transfers_refused():
                fn()
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with self.host_transfers_refused(), torch.cuda.graph(graph):
            fn()
        return graph.replay

    def compile(self, fn):
        """``fn`` (no arguments) compiled by ``torch.compile`` as one graph (Inductor: C++ on the CPU,
        Triton on CUDA), which fuses the step's elementwise passes.  While it traces, this backend
        runs PyTorch's ops only (``_tracing``): no NumPy products, no host threads, no blocks, and
        Backend's Adam in place of the fused kernel, whose step count is a host number.  Compiling
        happens on the first call; where it fails (no C++ compiler, a PyTorch without
        ``torch.compile``), that call and every later one run ``fn`` itself, after one warning."""
        if not self.compiles:
            return super().compile(fn)
        compiled = self.torch.compile(fn, fullgraph=True, dynamic=False)
        chosen = []  # after the first call: what every call runs

        def call():
            if chosen:
                return chosen[0]()
            try:
                out = compiled()  # fullgraph: compiles the whole of fn before running any of it
            except Exception as e:  # noqa: BLE001  a compiler's failure, reported once, then done without
                first = str(e).splitlines()[0][:200] if str(e) else ""
                warnings.warn(f"torch.compile could not compile the step ({type(e).__name__}: {first}); "
                              "it runs uncompiled", CompileWarning, stacklevel=2)
                chosen.append(fn)
                return fn()
            chosen.append(compiled)
            return out

        return call

    def _run_parts(self, fn, slices):
        if self._tracing():  # a traced step runs its parts one after another, as one graph
            for sl in slices:
                fn(sl)
            return
        super()._run_parts(fn, slices)

    def _sample_blocks(self, n, sample_size):
        return [slice(None)] if self._tracing() else super()._sample_blocks(n, sample_size)

    def _element_blocks(self, sizes):
        return [(key, slice(None)) for key in sizes] if self._tracing() else super()._element_blocks(sizes)

    def _as_caller(self, fn):
        """PyTorch's grad and inference modes are per thread: a pool thread runs a part in the
        caller's, so that a forward under ``torch.inference_mode()`` may write in place into the
        inference tensors it made (elsewhere refused as an update outside inference mode)."""
        torch = self.torch
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        def run(part):
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return fn(part)

        return run

    def split_batch(self, fn, n, sample_size=1):
        """Backend.split_batch's blocks one after another: PyTorch threads inside each op, and its
        ops called from several threads at once would compete for the same cores.  Where routing's
        products are NumPy's (``_numpy``), they are most of a block's time, and the blocks are
        spread over the threads as on NumPy (docs/performance.md)."""
        if self._numpy is not None:
            return super().split_batch(fn, n, sample_size)
        for sl in self._sample_blocks(n, sample_size):
            fn(sl)

    def contiguous(self, x):
        return x.contiguous()

    def adam(self, update, sizes, arrays, lr, betas, eps, step, scalars=None):
        """On the CPU, PyTorch's fused Adam: one kernel per parameter for the whole update, where
        optim.Adam's form takes a dozen passes (the same update to rounding: tests compare both, and
        torch.optim.Adam).  A CUDA device keeps Backend's form, which a recorded step replays with each
        step's scalars; so does step 0 (an apply() before any prepare(), which moves no weight), a
        compiled step (whose scalars are read from the device too) and a PyTorch without the CPU
        kernel (before 2.4)."""
        fused = getattr(self.torch, "_fused_adam_", None) if self._fused_adam else None
        if self._tracing() or self._device.type != "cpu" or fused is None or step < 1:
            return super().adam(update, sizes, arrays, lr, betas, eps, step)
        w, g, m, v = ([a[k] for k in sizes] for a in arrays)
        steps = [self.torch.tensor(float(step))] * len(w)  # read only: the bias corrections 1 - beta^step
        try:
            fused(w, g, m, v, [], steps, lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=0.0, eps=eps,
                  amsgrad=False, maximize=False)
        except (NotImplementedError, RuntimeError):  # no CPU kernel in this PyTorch: it refuses before writing
            self._fused_adam = False
            super().adam(update, sizes, arrays, lr, betas, eps, step)

    _fused_adam = True

    def relu_backward(self, dy, y):
        """dy where y > 0, else 0, in one pass (PyTorch's own ReLU backward, a plain op here: nothing
        requires grad); dy * (y > 0) takes two and converts the mask."""
        return self.torch.ops.aten.threshold_backward(dy, y, 0)

    def windows(self, x, kh, kw, stride):
        # unfold(dim, size, step) appends the window axis: (N, OH, OW, C, kh, kw) -> (N, OH, OW, kh, kw, C)
        return x.unfold(1, kh, stride).unfold(2, kw, stride).permute(0, 1, 2, 4, 5, 3)

    def synchronize(self) -> None:
        if self._device.type == "cuda":
            self.torch.cuda.synchronize(self._device)

    def out_of_memory(self, exc: BaseException) -> bool:
        """CUDA's torch.OutOfMemoryError; on the CPU, the allocator's RuntimeError."""
        torch = self.torch
        return (isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError))
                or isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))

    def memory(self) -> dict:
        if self._device.type == "cuda":
            c = self.torch.cuda
            return {"current": c.memory_allocated(self._device), "peak": c.max_memory_allocated(self._device),
                    "kind": "torch CUDA allocator"}
        return super().memory()

    def reset_peak_memory(self) -> None:
        if self._device.type == "cuda":
            self.torch.cuda.reset_peak_memory_stats(self._device)
        else:
            super().reset_peak_memory()


def _numpy_blas_is_faster() -> bool:
    """Whether this CPU backend's products go to NumPy's BLAS: ``PYCAPSNET_TORCH_CPU_MATMUL`` =
    ``numpy`` or ``torch`` where set, else where NumPy's BLAS is OpenBLAS and the CPU is an AMD one
    (where PyTorch's MKL is the slower of the two; on Intel CPUs MKL is PyTorch's own choice)."""
    choice = os.environ.get("PYCAPSNET_TORCH_CPU_MATMUL", "").strip().lower()
    if choice in ("numpy", "torch"):
        return choice == "numpy"
    if choice:
        raise BackendError(f"PYCAPSNET_TORCH_CPU_MATMUL={choice!r}: use 'numpy' (NumPy's BLAS) or 'torch' "
                           "(PyTorch's own), or unset it to choose by CPU")
    return cpu_vendor() == "AuthenticAMD" and "openblas" in _blas_name()


def _direct_conv() -> bool:
    """Whether the CPU backend convolves with PyTorch's own kernels: yes, unless
    ``PYCAPSNET_TORCH_CPU_CONV=im2col`` keeps the layer's im2col products (to compare the two)."""
    choice = os.environ.get("PYCAPSNET_TORCH_CPU_CONV", "").strip().lower()
    if choice not in ("", "torch", "im2col"):
        raise BackendError(f"PYCAPSNET_TORCH_CPU_CONV={choice!r}: use 'torch' (PyTorch's own convolution, "
                           "the default) or 'im2col' (the layer's matrix products)")
    return choice != "im2col"


def _oihw(W):
    """A kernel (kh, kw, C_in, C_out) as PyTorch's (C_out, C_in, kh, kw), laid out as it expects."""
    return W.permute(3, 2, 0, 1).contiguous()


class TorchAutogradBackend(TorchBackend):
    """The torch backend with every named operation in PyTorch's own differentiable ops (as while
    torch.compile traces a step: no NumPy products writing into tensors' memory) and the batch
    routed as one block.  What the automatic reference of a routing's backward runs the routing's
    forward on, for PyTorch's autograd to differentiate (pycapsnet/tools/routing_checks.py); never
    the training path, where nothing requires grad."""

    def _tracing(self) -> bool:
        return True

    def split_batch(self, fn, n, sample_size=1):
        fn(slice(None))
