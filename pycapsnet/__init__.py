"""pycapsnet: Capsule Networks (Sabour, Frosst & Hinton 2017) with hand-written forward and backward
passes, written once against an abstract array backend (NumPy, CuPy, PyTorch)."""
from .errors import BackendError, CapsNetError, TrainingDiverged
from .core.model import CapsNet, CapsNetConfig, Outputs

__version__ = "0.1.0"
__all__ = ["CapsNet", "CapsNetConfig", "Outputs", "CapsNetError", "BackendError", "TrainingDiverged", "Model", "build", "load",
           "load_digits", "__version__"]


def build(network="capsnet", **options):
    """A new ``Model`` (pycapsnet.api.build): the paper's CapsNet, "attention", "em", or a description."""
    from .api import build as _build

    return _build(network, **options)


def load(path: str, backend: str = "numpy", device: str | None = None, dtype: str | None = None):
    """A ``Model`` from a run directory, a checkpoint file or a file ``Model.save`` wrote: fit,
    evaluate, predict (arrays, or image files read as the run read its own), save, summary."""
    from .api import Model

    return Model.from_checkpoint(path, backend, device, dtype)


def __getattr__(name):
    if name in ("Model", "load_digits"):  # imported when asked for: pycapsnet.api reads the training package
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'pycapsnet' has no attribute {name!r}")
