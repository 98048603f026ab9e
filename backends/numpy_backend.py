"""NumPy backend (CPU).  The CuPy backend subclasses it: CuPy mirrors NumPy's API, so the only
differences are the module and the host transfers -- what the CPU tests cover, the GPU confirms."""
from __future__ import annotations

import os

import numpy as np

from .base import Backend, keep_freed_memory


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
