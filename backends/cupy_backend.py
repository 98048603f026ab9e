"""CuPy backend (CUDA): the NumPy backend with cupy as the array module, plus a CUDA graph for
``capture``."""
from __future__ import annotations

import contextlib

import numpy as np

from .base import BackendError
from .numpy_backend import NumpyBackend


class CupyBackend(NumpyBackend):
    name = "cupy"
    # ``capture`` records a CUDA graph, but it has not yet run on a GPU: until a GPU run of
    # tests/test_graph.py and ``benchmarks/bench.py --backends cupy+graph`` shows it equal to the
    # step op by op and faster, the trainer does not use it.  The benchmark's ``cupy+graph`` does.
    can_capture = False

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
        import array_api_compat.cupy as xp

        self.device = f"cuda:{index}"
        self._cuda_device = cupy.cuda.Device(index)
        self._cuda_device.use()
        self.xp = xp
        self.lib = cupy
        self.threads = 1  # the GPU parallelises; host threads would only add launch overhead
        self.elementwise_block = None  # whole arrays: blocks would only add launches
        self._graph_pools = []  # the memory of every recorded graph, for as long as the backend lives

    def to_numpy(self, x) -> np.ndarray:
        self._check_host_transfer("a device-to-host copy")
        return self.lib.asnumpy(x)

    def synchronize(self) -> None:
        self.lib.cuda.runtime.deviceSynchronize()

    def capture(self, fn):
        """A CUDA graph of ``fn`` (CuPy's stream capture), replayed with one launch on the stream
        current at the call.

        As on torch, ``fn`` first runs twice on a side stream -- kernels compile, cuBLAS makes its
        handle, layers build their constants -- the second time with host transfers refused; then
        the third run is recorded.  A graph replays into the addresses it was recorded with, so its
        arrays come from a memory pool of its own: CuPy's default pool would hand them to later
        allocations once the recording freed them, and its ``free_all_blocks`` (the benchmark's
        memory reset) would give them back to CUDA.  The pool stays with the backend, as the model's
        gradients and the step's outputs may live in it."""
        cuda = self.lib.cuda
        pool = cuda.MemoryPool()
        self._graph_pools.append(pool)
        side = cuda.Stream(non_blocking=True)  # capture cannot run on the legacy default stream
        side.wait_event(cuda.get_current_stream().record())  # the step's inputs are written there
        with cuda.using_allocator(pool.malloc), side:
            fn()
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
        cuda.get_current_stream().wait_event(side.record())  # later work follows the warm-up runs

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

