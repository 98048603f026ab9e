"""CuPy backend (CUDA): the NumPy backend with cupy as the array module, plus a CUDA graph for
``capture`` (whose matrix products call cuBLAS directly: backends/cublas.py)."""
from __future__ import annotations

import contextlib

import numpy as np

from .base import array_api, Backend, BackendError
from .cupy_kernels import CupyKernels
from .numpy_backend import NumpyBackend


class _CupyNamespace:
    """array_api_compat.cupy, with ``clip`` sent to ``cupy.clip``.  The compat ``clip`` of a float
    array with a scalar bound copies through boolean masks, whose sizes CuPy reads on the host: a
    device-to-host wait in every ReLU and margin loss, which a recorded step cannot hold.
    ``kernels``: the fused kernels that replace pycapsnet.core's ``@fusable`` functions."""

    def __init__(self, compat, cupy):
        self._compat, self._cupy = compat, cupy

    def __getattr__(self, name):
        value = getattr(self._compat, name)
        setattr(self, name, value)  # looked up once
        return value

    def clip(self, x, /, min=None, max=None):
        return self._cupy.clip(x, min, max)


class CupyBackend(NumpyBackend):
    name = "cupy"
    library = "cupy"
    # the trainer records full batches as a CUDA graph (``capture``): a step op by op is hundreds of
    # kernel launches from Python, which cost more than the kernels (docs/performance.md, GPU)
    can_capture = True

    def __init__(self, dtype: str = "float32", device: str = "cuda"):
        try:
            import cupy
        except ImportError as e:
            raise BackendError(
                "the cupy backend needs CuPy, which is not installed: "
                "pip install 'pycapsnet[cupy]' (or pip install cupy-cuda12x)") from e
        try:
            n_gpu = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDA driver missing or broken
            raise BackendError(f"the cupy backend needs a CUDA GPU, and CUDA reports none ({e})") from e
        if n_gpu == 0:
            raise BackendError("the cupy backend needs a CUDA GPU, and none is visible")
        index = 0
        if device not in (None, "cuda"):
            if not str(device).startswith("cuda:"):
                raise BackendError(f"the cupy backend runs on CUDA devices ('cuda' or 'cuda:N'), not {device!r}")
            index = int(str(device).split(":")[1])
        super().__init__(dtype, "cpu")
        compat = array_api("cupy")

        self.device = f"cuda:{index}"
        self._cuda_device = cupy.cuda.Device(index)
        self._cuda_device.use()
        self.xp = _CupyNamespace(compat, cupy)
        self.xp.kernels = CupyKernels(cupy)  # squash and routing's softmax fused (pycapsnet.core.fusable)
        self.lib = cupy
        self.threads = 1  # the GPU parallelises; host threads would only add launch overhead
        self.elementwise_block = None  # whole arrays: blocks would only add launches
        self._graph_pools = []  # the memory of every recorded graph, for as long as the backend lives
        self._graph_blas = []   # and the cuBLAS handle and workspace each graph's products use
        self._direct_cublas = None  # set while a step is recorded: matmul then calls cuBLAS itself

    collective_backend = "nccl"
    # EM routing: the whole batch in one part, and the sums as broadcasts and reductions (CuPy's einsum
    # may call cuBLAS, which a recorded graph refuses)
    sample_block = None
    sum_children = Backend.sum_children
    sum_children_pair = Backend.sum_children_pair
    sum_entries = Backend.sum_entries
    votes = Backend.votes  # products written through strided views: not tried on a GPU yet
    votes_backward = Backend.votes_backward

    def as_torch(self, x):
        """The same device memory as a torch CUDA tensor, through DLPack (no copy)."""
        import torch

        return torch.from_dlpack(x)

    def matmul(self, a, b):
        if self._direct_cublas is not None:
            return self._direct_cublas.matmul(a, b)
        return super().matmul(a, b)  # CuPy's own: a @ b

    # The routing products (see Backend): cupy.einsum op by op; while a step is recorded, batched
    # products through ``matmul`` (which then calls cuBLAS itself: cupy.einsum's would refuse).
    def weighted_sum(self, c, u_hat):
        if self._direct_cublas is not None:
            return weighted_sum_by_matmul(self, c, u_hat)
        return self._einsum("nji,injd->njd", c, u_hat)

    def agreement(self, u_hat, v):
        if self._direct_cublas is not None:
            return agreement_by_matmul(self, u_hat, v)
        return self._einsum("injd,njd->nji", u_hat, v)

    def outer_sum(self, coeffs, vecs, out=None):
        C, V = self.xp.stack(coeffs), self.xp.stack(vecs)
        if self._direct_cublas is not None:
            return outer_sum_by_matmul(self, C, V, out)
        return self._into(self.lib.einsum("qnji,qnjd->injd", C, V, optimize=False), out)

    def adam(self, update, sizes, arrays, lr, betas, eps, step, scalars=None):
        """One fused kernel per parameter (cupy_kernels.ADAM) where Backend's form takes eight passes.
        It reads the step's scalars from the device, so a recorded step replays it with each step's."""
        if scalars is None:
            return super().adam(update, sizes, arrays, lr, betas, eps, step)
        w, g, m, v = arrays
        for k in sizes:
            self.xp.kernels.adam(w[k], g[k], m[k], v[k], *scalars, betas, eps)

    def _einsum(self, subscripts, a, b):
        # (its result follows the operands' memory order; the layers expect C order)
        return self.lib.ascontiguousarray(self.lib.einsum(subscripts, a, b, optimize=False))

    def _make_direct_cublas(self, stream):
        from .cublas import DirectCublas

        return DirectCublas(self.lib, stream)

    def digamma(self, x):
        from cupyx.scipy import special

        return special.digamma(x)

    trigamma = Backend.trigamma  # the series to float64's precision, not SciPy's (which CuPy lacks on the device)

    def to_numpy(self, x) -> np.ndarray:
        self._check_host_transfer("a device-to-host copy")
        return self.lib.asnumpy(x)

    def synchronize(self) -> None:
        self.lib.cuda.runtime.deviceSynchronize()

    def capture(self, fn):
        """A CUDA graph of ``fn`` (CuPy's stream capture), replayed with one launch on the stream
        current at the call.

        As on torch, ``fn`` first runs twice on a side stream -- kernels compile, cuBLAS loads,
        layers build their constants -- the second time with host transfers refused; then the third
        run is recorded.  CuPy refuses cuBLAS on a capturing stream, so from the second run on,
        ``matmul`` and the routing products call cuBLAS directly (backends/cublas.py).

        A graph replays into the addresses it was recorded with, so its arrays come from a memory
        pool of its own: CuPy's default pool would hand them to later allocations once the
        recording freed them, and its ``free_all_blocks`` (the benchmark's memory reset) would give
        them back to CUDA.  The pool stays with the backend, as the model's gradients and the
        step's outputs may live in it."""
        cuda = self.lib.cuda
        pool = cuda.MemoryPool()
        self._graph_pools.append(pool)
        side = cuda.Stream(non_blocking=True)  # capture cannot run on the legacy default stream
        side.wait_event(cuda.get_current_stream().record())  # the step's inputs are written there
        with cuda.using_allocator(pool.malloc), side:
            fn()  # with CuPy's matmul, which also loads cuBLAS
            self._direct_cublas = self._make_direct_cublas(side)  # CuPy's matmul refuses to record
            try:
                with self.host_transfers_refused():
                    fn()
                    side.begin_capture()
                    try:
                        fn()
                    except BaseException:
                        with contextlib.suppress(Exception):  # end the broken capture; its error is fn's
                            side.end_capture()
                        raise
                    graph = side.end_capture()
            except BaseException:
                self._direct_cublas.close()
                raise
            finally:
                blas, self._direct_cublas = self._direct_cublas, None
        cuda.get_current_stream().wait_event(side.record())  # later work follows the warm-up runs
        self._graph_blas.append(blas)  # its workspace is in the graph

        def replay():
            graph.launch(stream=cuda.get_current_stream())

        return replay

    def memory(self) -> dict:
        # the default pool and every graph's own: the graphs' arrays live as long as the backend
        pools = [self.lib.get_default_memory_pool(), *self._graph_pools]
        return {"current": sum(p.used_bytes() for p in pools), "peak": sum(p.total_bytes() for p in pools),
                "kind": "cupy memory pools"}

    def reset_peak_memory(self) -> None:
        # CuPy keeps no high-water mark; its pool only grows between frees, so after freeing the
        # cached blocks, total_bytes() is the peak reserved by whatever runs next.
        self.lib.get_default_memory_pool().free_all_blocks()


# The routing products as one batched matrix product each, the batch being the (n, j) pairs -- the
# form cuBLAS records.  Written with the backend's xp and matmul, so the CPU tests run them too.
def weighted_sum_by_matmul(B, c, u_hat):
    """s[n, j] = c[n, j, :] (1, I) @ û[:, n, j, :] (I, D)."""
    xp = B.xp
    i, n, j, d = u_hat.shape
    u = xp.reshape(xp.permute_dims(u_hat, (1, 2, 0, 3)), (n * j, i, d))
    return xp.reshape(B.matmul(xp.reshape(c, (n * j, 1, i)), u), (n, j, d))


def agreement_by_matmul(B, u_hat, v):
    """a[n, j] = û[:, n, j, :] (I, D) @ v[n, j] (D, 1)."""
    xp = B.xp
    i, n, j, d = u_hat.shape
    u = xp.reshape(xp.permute_dims(u_hat, (1, 2, 0, 3)), (n * j, i, d))
    return xp.reshape(B.matmul(u, xp.reshape(v, (n * j, d, 1))), (n, j, i))


def outer_sum_by_matmul(B, C, V, out=None):
    """dû[:, n, j] = C[:, n, j, :]^T (I, Q) @ V[:, n, j] (Q, D); C (Q, N, J, I), V (Q, N, J, D);
    laid out (I, N, J, D), in ``out`` when given."""
    xp = B.xp
    q, n, j, i = C.shape
    d = V.shape[-1]
    Cm = xp.reshape(xp.permute_dims(C, (1, 2, 3, 0)), (n * j, i, q))
    Vm = xp.reshape(xp.permute_dims(V, (1, 2, 0, 3)), (n * j, q, d))
    return B._into(xp.permute_dims(xp.reshape(B.matmul(Cm, Vm), (n, j, i, d)), (2, 0, 1, 3)), out)
