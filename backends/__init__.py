"""Array backends for pycapsnet: ``backends.get("numpy" | "cupy" | "torch", device=..., dtype=...)``.

Each backend is a small subclass of :class:`backends.base.Backend` (after einops' backend layer);
its library is imported only when the backend is created, so ``import backends`` -- and
``import pycapsnet`` -- pull in neither CuPy nor PyTorch.
"""
from __future__ import annotations

import os
import sys

# NumPy's BLAS, OpenBLAS, keeps its idle worker threads spinning for a while (2^28 cycles) after
# every product.  On a machine with few cores they then hold the cores that the NumPy backend's own
# threads (the routing products and small products split over the batch) need; told to sleep after
# 2^16 cycles, they give the cores back (docs/performance.md, "What limits each machine").  OpenBLAS reads
# this when NumPy loads it, so it applies when this package is imported before NumPy, as the
# training scripts, the CLI and the benchmarks do.  A value already in the environment wins.  When
# NumPy came first, the setting is too late for this process (the numpy backend then warns:
# ``PerformanceWarning``), but still reaches the processes it starts.
OPENBLAS_TIMEOUT_TOO_LATE = "numpy" in sys.modules and "OPENBLAS_THREAD_TIMEOUT" not in os.environ
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")

from .base import Backend, BackendError, PerformanceWarning  # noqa: E402  (after the setting: base imports NumPy)

# name -> (module, class); imported on first use
_REGISTRY = {
    "numpy": ("numpy_backend", "NumpyBackend"),
    "cupy": ("cupy_backend", "CupyBackend"),
    "torch": ("torch_backend", "TorchBackend"),
}
NAMES = tuple(_REGISTRY)


def get(name: str, device: str | None = None, dtype: str = "float32") -> Backend:
    """Create a backend by name.  ``name`` may carry the device: ``"torch:cuda"``, ``"cupy:cuda:1"``.

    Raises BackendError with the fix for an unknown name, a missing library, a missing GPU or a
    dtype other than float32/float64."""
    if isinstance(name, Backend):
        return name
    name = str(name)
    if ":" in name and device is None:
        name, device = name.split(":", 1)
    if name not in _REGISTRY:
        raise BackendError(f"unknown backend {name!r}: choose one of {', '.join(NAMES)}")
    module, cls = _REGISTRY[name]
    import importlib

    backend_cls = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    kwargs = {"dtype": dtype}
    if device is not None:
        kwargs["device"] = device
    return backend_cls(**kwargs)


def device_for_rank(device: str | None, local_rank: int, name: str) -> str | None:
    """The device of one process of a data-parallel run on one machine: a GPU backend's 'cuda'
    (or nothing, for CuPy) becomes 'cuda:LOCAL_RANK', one GPU per process; an explicit index or
    the CPU stays as given."""
    spec = str(device) if device is not None else ("cuda" if name == "cupy" else None)
    return f"cuda:{local_rank}" if spec == "cuda" else device


def gpu_unavailable_reason(name: str) -> str | None:
    """None when backend ``name`` ("cupy" or "torch") can run on a GPU here, else why not."""
    try:
        get(name, device="cuda")
    except BackendError as e:
        return str(e)
    return None


__all__ = ["Backend", "BackendError", "PerformanceWarning", "get", "gpu_unavailable_reason", "device_for_rank",
           "NAMES"]
