"""pycapsnet: Capsule Networks (Sabour, Frosst & Hinton 2017) with hand-written forward and backward
passes, written once against an abstract array backend (NumPy, CuPy, PyTorch)."""
from .errors import BackendError, CapsNetError
from .core.model import CapsNet, CapsNetConfig, Outputs

__version__ = "0.1.0"
__all__ = ["CapsNet", "CapsNetConfig", "Outputs", "CapsNetError", "BackendError", "load", "__version__"]


def load(run: str, backend: str = "numpy", device: str | None = None, dtype: str | None = None):
    """A trained run (its directory or checkpoint file), ready to classify image files:
    ``load("runs/mine").predict(["cat.png"], top=2)``; ``.model``, ``.classes``, ``.read(path)``
    (pycapsnet.tools.predict)."""
    from .tools.predict import load as _load

    return _load(run, backend, device, dtype)
