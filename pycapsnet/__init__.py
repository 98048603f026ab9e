"""pycapsnet: Capsule Networks (Sabour, Frosst & Hinton 2017) with hand-written forward and backward
passes, written once against an abstract array backend (NumPy, CuPy, PyTorch)."""
from .errors import BackendError, CapsNetError
from .core.model import CapsNet, CapsNetConfig, Outputs

__version__ = "0.1.0"
__all__ = ["CapsNet", "CapsNetConfig", "Outputs", "CapsNetError", "BackendError", "__version__"]
