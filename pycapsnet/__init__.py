"""pycapsnet: Capsule Networks (Sabour, Frosst & Hinton 2017) with hand-written forward and backward
passes, written once against an abstract array backend (NumPy, CuPy, PyTorch)."""
from __future__ import annotations

from .errors import BackendError, CapsNetError, TrainingDiverged
from .core.model import CapsNet, CapsNetConfig, Outputs

__version__ = "0.1.0"
__all__ = ["CapsNet", "CapsNetConfig", "Outputs", "CapsNetError", "BackendError", "TrainingDiverged", "Model", "build", "load",
           "load_digits", "datasets", "study", "optim", "__version__"]


def build(network="capsnet", **options):
    """A new ``Model``: ``network`` "capsnet" (the paper's, dynamic routing), "attention", "em", the paper's
    network routed by "uniform", "random", "inverted", "self" or "vb", a description the package
    carries ("efficient": Efficient-CapsNet; "capsnet-published": the paper's network as its code
    builds it), or your own (architecture.network(...) or its JSON file).  Keywords: input_shape
    (C, H, W), n_classes, backend ("numpy", "torch", "cupy"), device, dtype, seed, classes (names),
    and a built-in network's CapsNetConfig fields (routing_iters=1, ...).  pycapsnet.api.build."""
    from .api import build as _build  # (lazy: `import pycapsnet` stays light; the training package loads here)

    return _build(network, **options)


def load(path: str, backend: str = "numpy", device: str | None = None, dtype: str | None = None,
         strict: bool = False):
    """A ``Model`` from a run directory, a checkpoint file or a file ``Model.save`` wrote: fit,
    evaluate, predict (arrays, or image files read as the run read its own), save, summary.
    ``strict``: refuse a checkpoint whose routing's source differs from the one registered here
    (else one line of warning)."""
    from .api import Model  # (lazy, as build's)
    from .core import routing_source

    was = routing_source.strict()
    try:
        routing_source.strict(strict is True or was)
        return Model.from_checkpoint(path, backend, device, dtype)
    finally:
        routing_source.strict(was)


_LAZY = {"Model": "api", "load_digits": "api", "datasets": None, "study": None, "optim": None}


def __getattr__(name):
    """What is imported when first asked for: pycapsnet.api reads the training package, and study
    imports PyTorch only for its autograd twin."""
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
        return module if _LAZY[name] is None else getattr(module, name)
    raise AttributeError(f"module 'pycapsnet' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY})
