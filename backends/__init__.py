"""Array backends for pycapsnet: ``backends.get("numpy" | "cupy" | "torch", device=..., dtype=...)``.

This folder installs as ``pycapsnet.backends`` (``from pycapsnet import backends``): the package
claims no top-level name but its own.  Each backend is a small subclass of
:class:`pycapsnet.backends.base.Backend` (after einops' backend layer); its library is imported only
when the backend is created, so ``import pycapsnet`` pulls in neither CuPy nor PyTorch.
"""
from __future__ import annotations

import importlib
import os
import sys

# NumPy's BLAS, OpenBLAS, keeps its idle worker threads spinning for a while (2^28 cycles) after
# every product.  On a machine with few cores they then hold the cores that the NumPy backend's own
# threads (the routing products and small products split over the batch) need; told to sleep after
# 2^16 cycles, they give the cores back (docs/performance.md, "What limits each machine").  OpenBLAS
# reads this setting when NumPy loads it: so it is set here, before this package first imports
# NumPy.  A value already in the environment wins.  Where NumPy came first (a notebook's first
# line), OpenBLAS is told again and its threads restarted (host.rearm_blas_thread_timeout).
if "OPENBLAS_THREAD_TIMEOUT" not in os.environ:
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = "16"
    if "numpy" in sys.modules:
        from .host import rearm_blas_thread_timeout

        rearm_blas_thread_timeout()

from .base import Backend, BackendError  # noqa: E402  (after the setting: base imports NumPy)
from . import host  # noqa: E402

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
    if hasattr(name, "xp") and type(name).__name__.endswith("Backend"):
        # a backend of another copy of this package (``import backends`` from the repository's root
        # loads the folder a second time, beside pycapsnet.backends): the same backend of this copy
        return get(name.name, device=None if name.device == "cpu" else name.device, dtype=name.dtype)
    name = str(name)
    if ":" in name and device is None:
        name, device = name.split(":", 1)
    if name not in _REGISTRY:
        raise BackendError(f"unknown backend {name!r}: choose one of {', '.join(NAMES)}")
    module, cls = _REGISTRY[name]
    backend_cls = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    kwargs = {"dtype": dtype}
    if device is not None:
        kwargs["device"] = device
    return backend_cls(**kwargs)


def autograd_reference(dtype: str = "float64", device: str = "cpu") -> Backend:
    """The torch backend in PyTorch's differentiable ops only (torch_backend.TorchAutogradBackend):
    a routing's forward run on it can be differentiated by autograd, the independent reference of
    its hand-written backward."""
    try:
        from .torch_backend import TorchAutogradBackend
    except ImportError as e:  # pragma: no cover - torch_backend imports nothing of torch at module level
        raise BackendError(f"the autograd reference needs PyTorch: {e}") from e
    return TorchAutogradBackend(dtype=dtype, device=device)


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


def busy_machine_note(B: Backend, window: float = 0.1) -> str | None:
    """A line for a run about to start on the CPU backend ``B``, where other processes keep some of
    the cores it spreads its work over busy, else None.  On every core a step then waits for the
    busy ones (a 2-core machine with one busy: 0.74x the speed of one thread, docs/performance.md).
    Only said, not changed: the BLAS's thread count changes a step's float rounding, so a count
    that followed the machine's load would make a run's numbers depend on it.  Nothing is said
    where the user chose the threads (PYCAPSNET_THREADS or OMP_NUM_THREADS)."""
    chosen = any(os.environ.get(k, "").strip() for k in ("PYCAPSNET_THREADS", "OMP_NUM_THREADS"))
    threads = getattr(B, "threads", 1)
    if B.device != "cpu" or chosen or threads <= 1:
        return None
    busy = host.busy_cores(window)
    if busy is None or busy < 0.5:
        return None
    free = max(1, threads - round(busy))
    if free >= threads:
        return None
    return (f"note: other processes keep about {busy:.1f} of this machine's {threads} cores busy, and a step spread "
            f"over all {threads} waits for them; on the free ones it would be faster: OMP_NUM_THREADS={free} "
            f"PYCAPSNET_THREADS={free} (the thread count changes the float rounding: a record keeps it fixed)")


__all__ = ["Backend", "BackendError", "get", "gpu_unavailable_reason", "device_for_rank", "autograd_reference",
           "busy_machine_note",
           "NAMES"]
