"""CuPy backend (CUDA): the NumPy backend with cupy as the array module."""
from __future__ import annotations

import numpy as np

from .base import BackendError
from .numpy_backend import NumpyBackend


class CupyBackend(NumpyBackend):
    name = "cupy"

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

    def to_numpy(self, x) -> np.ndarray:
        self._check_host_transfer("a device-to-host copy")
        return self.lib.asnumpy(x)

    def synchronize(self) -> None:
        self.lib.cuda.runtime.deviceSynchronize()

    def memory(self) -> dict:
        pool = self.lib.get_default_memory_pool()
        return {"current": pool.used_bytes(), "peak": pool.total_bytes(), "kind": "cupy memory pool"}

    def reset_peak_memory(self) -> None:
        # CuPy keeps no high-water mark; its pool only grows between frees, so after freeing the
        # cached blocks, total_bytes() is the peak reserved by whatever runs next.
        self.lib.get_default_memory_pool().free_all_blocks()

